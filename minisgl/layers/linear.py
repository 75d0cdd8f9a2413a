"""Linear layers that know their tensor-parallel shard.

Column-parallel layers split output features across ranks; row-parallel layers split input
features and all-reduce the partial sums. Each parameter carries a `weight_loader` that takes the
full checkpoint tensor (or one shard of a fused layer) and copies this rank's slice in.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.kernels.impl import resolve_impl
from minisgl.platform import current

WeightLoader = Callable[..., None]
LinearFn = Callable[..., torch.Tensor]


class LinearDelta(Protocol):
    """Something added onto a layer's output (a LoRA adapter's B @ A @ x: lora/layer.py). On a
    row-parallel layer it is added to this rank's partial sum, before the all-reduce."""

    def add_(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


class PartRows(NamedTuple):
    """Where one checkpoint part lands in this rank's output rows: rows [offset, offset + size)
    hold shard `shard` (of `size` rows) of the part's full tensor."""

    offset: int
    size: int
    shard: int


def select_linear(weight: torch.Tensor) -> LinearFn:
    """`F.linear`, or, for a model built in bf16 on CPU, the C++ GEMV / small GEMM that falls back
    to it for larger batches (`kernels/cpu_ops.py`). Chosen once per layer, as `kernels.impl` does
    for the fused ops."""
    if resolve_impl("auto", weight.device) == "cpu":
        from minisgl.kernels import cpu_ops

        return cpu_ops.linear
    return F.linear


def add_linear_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, splitk: bool = False) -> torch.Tensor:
    """residual += x @ weight.T, in place (no bias, one rank), in the GEMM's epilogue: with
    `splitk` (a layer's choice, made once) the split-K kernel where the measured table says it
    pays for this shape and row count, else cuBLAS's beta = 1. Returns `residual`."""
    if splitk:
        from minisgl.kernels import gemm  # here: it imports triton, which a CPU process never needs

        if gemm.pays(x, weight):
            return gemm.splitk_gemm(x, weight, residual=residual, out=residual)
    return residual.addmm_(x, weight.t())


def _set_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class _ShardedLinear(nn.Module):
    """What both layouts share: this rank's weight [rows, cols], the matmul chosen once for it,
    the LoRA delta hook, and handing the weight to a function that holds it (`use_weight_fn`)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self._linear = select_linear(self.weight)
        self.weight_held_by_fn = False  # set by use_weight_fn
        self.lora: LinearDelta | None = None  # set by lora/layer.py when adapters are served

    def use_weight_fn(self, fn: LinearFn, sharded: bool = False) -> None:
        """At load, once: `fn(x, weight[, bias])` computes the layer and holds its weight (GGUF
        blocks: layers/quant.py; `sharded`: fn holds this rank's shard, any TP size: float8
        weights, layers/fp8.py). The float parameter is replaced by an empty one (its memory was
        never written: the model is built with `torch.empty`)."""
        if get_tp_info().size != 1 and not sharded:
            raise ValueError("weights held outside the layer (--weights gguf) run at one rank: pass --weights float32")
        self._linear = fn
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight_held_by_fn = True


class ColumnParallelLinear(_ShardedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.out_per_rank = divide(out_features, get_tp_info().size, "output features")
        super().__init__(self.out_per_rank, in_features)
        _set_loader(self.weight, self._load)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank)) if bias else None
        if self.bias is not None:
            _set_loader(self.bias, self._load)

    @property
    def parts(self) -> tuple[str | int | None, ...]:
        """The checkpoint parts fused into this layer (None: the layer is one part)."""
        return (None,)

    def part_rows(self, part: str | int | None = None) -> PartRows:
        """Where `part` sits in this rank's output rows (the weight loader's and LoRA's B split)."""
        assert part is None, f"{type(self).__name__} has no part {part!r}"
        return PartRows(0, self.out_per_rank, self.tp_rank)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str | int | None = None) -> None:
        """Checkpoint part `part` (the whole layer: None) -> its shard, into its rows (`part_rows`)."""
        offset, size, shard = self.part_rows(part)
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, shard * size, size))  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_(x, out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate|up).

    Each rank holds its slice of every part: [part0 shard | part1 shard | ...].
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_info()
        self.part_per_rank = [divide(size, tp.size, "output features") for size in part_sizes]
        super().__init__(in_features, sum(part_sizes), bias)

    @property
    def parts(self) -> tuple[str | int | None, ...]:
        return tuple(range(len(self.part_per_rank)))

    def part_rows(self, part: str | int | None = None) -> PartRows:
        assert isinstance(part, int), "a merged projection is loaded one part at a time"
        return PartRows(sum(self.part_per_rank[:part]), self.part_per_rank[part], self.tp_rank)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection. KV heads are split across ranks, or replicated when fewer than ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_info()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "key/value heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = divide(tp.size, num_kv_heads, "tensor-parallel size over key/value heads")
            self.num_kv_heads = 1
        total_per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, total_per_rank * tp.size, bias)

    @property
    def parts(self) -> tuple[str | int | None, ...]:
        return ("q", "k", "v")

    def part_rows(self, part: str | int | None = None) -> PartRows:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if part == "q":
            return PartRows(0, q_size, self.tp_rank)
        if part in ("k", "v"):
            return PartRows(q_size if part == "k" else q_size + kv_size, kv_size, self.tp_rank // self.kv_replicas)
        raise AssertionError(f"unknown qkv part {part!r}")


class RowParallelLinear(_ShardedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.in_per_rank = divide(in_features, get_tp_info().size, "input features")
        super().__init__(out_features, self.in_per_rank)
        # `add_to_`: the split-K Triton GEMM where the platform compiles Triton (--triton-gemm).
        self._splitk = current().kernels.triton_gemm
        _set_loader(self.weight, self._load_weight)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            _set_loader(self.bias, lambda p, w: _copy(p, w))

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, loaded.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.weight)
        if self.lora is not None:  # this rank's share of the delta (A is split like x), summed below
            self.lora.add_(x, out)
        out = all_reduce(out)
        # Bias is added once, after the reduction.
        return out if self.bias is None else out + self.bias

    def add_to_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x @ W.T in place, in the GEMM's epilogue (no bias, one rank: the folded
        layer of models/llama.py). Returns `residual`."""
        assert self.bias is None and self.tp_size == 1
        if self.lora is not None:
            return residual.add_(self.forward(x))
        if self.weight_held_by_fn:
            return residual.add_(self._linear(x, self.weight))
        return add_linear_(residual, x, self.weight, self._splitk)
