"""Linear layers and experts over float8 e4m3 weights (FP8 W8A8: models/quant_fp8.py loads them).

A linear layer's weight becomes `Fp8LinearFn` (given to `use_weight_fn`): the float8 [N, K] weight
of this rank and its fp32 scales in kernels/fp8_ref.py's layout, [N, 1] per row or [N, G] per row
and K-group. The activations are quantized per token (and group) on each call; the implementation
is the Triton GEMM (kernels/fp8_gemm.py) where Triton compiles, else the torch reference
(`fp8_linear_ref`: dequantize both sides, multiply in fp32).

Before a float8 checkpoint loads, `to_fp8_params` turns the layer's weight into a float8
parameter of the same shape and adds the scale parameter under the checkpoint's name
(`weight_scale` / `weight_scale_inv`), whose loader spreads a per-tensor, per-channel or block
scale over the rows and then shards it as the layer shards its weight.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import torch
from torch import nn

from minisgl.distributed import get_tp_info
from minisgl.kernels.fp8_ref import (FP8_DTYPE, block_scales_to_rows, dequantize_fp8, fp8_linear_ref, quantize_fp8,
                                      quantize_weight_blocks)
from minisgl.kernels.impl import triton_installed
from minisgl.kernels.moe_ref import moe_ref
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.moe import ExpertDown, ExpertGateUp, FusedExperts
from minisgl.platform import compiles_triton

Fp8Impl = Literal["triton", "torch"]
ScaleLayout = Literal["tensor", "channel", "block"]


def select_fp8_impl(device: torch.device) -> Fp8Impl:
    """The Triton GEMM where Triton compiles (CUDA, sm89+: float8 tensor cores); the reference
    elsewhere (the interpreter is for tests, which ask for `with_impl("triton")` themselves)."""
    if not (compiles_triton(device) and triton_installed()):
        return "torch"
    from minisgl.kernels.fp8_gemm import supported

    return "triton" if supported(device) else "torch"


class Fp8LinearFn:
    """A `LinearFn` holding a float8 weight [N, K] and its scales ([N, 1] or [N, ceil(K / group)]).
    The `weight` argument (the layer's emptied float parameter) is not read."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, group: int | None, impl: Fp8Impl) -> None:
        assert qweight.dtype == FP8_DTYPE and qweight.dim() == 2, (qweight.dtype, qweight.shape)
        groups = 1 if group is None else -(-qweight.shape[1] // group)
        assert scale.shape == (qweight.shape[0], groups), (scale.shape, qweight.shape, group)
        self.qweight, self.scale, self.group, self.impl = qweight.contiguous(), scale.float().contiguous(), group, impl
        self.out_features = qweight.shape[0]
        self.nbytes = self.qweight.numel() + 4 * self.scale.numel()  # what a step reads (bench.roofline)
        self._fn: Callable[..., torch.Tensor] = fp8_linear_ref
        if impl == "triton":
            from minisgl.kernels.fp8_gemm import block_scales, fp8_linear  # the CPU path never imports triton

            self._fn = functools.partial(fp8_linear, blocks=block_scales(self.scale, group))

    def with_impl(self, impl: Fp8Impl) -> Fp8LinearFn:
        return Fp8LinearFn(self.qweight, self.scale, self.group, impl)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer multiplies by (tests, references)."""
        return dequantize_fp8(self.qweight, self.scale, self.group)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return self._fn(x, self.qweight, self.scale, self.group, bias)


def scale_rows(loaded: torch.Tensor, layout: ScaleLayout, rows: int, block_rows: int) -> torch.Tensor:
    """A checkpoint scale as one row per weight row: [rows, G] (`rows` bounds the part's rows: a
    per-tensor scale is broadcast, a block scale repeated over its block's rows)."""
    if layout == "tensor":
        if loaded.numel() != 1:
            raise ValueError(f"per-tensor fp8 scale of shape {tuple(loaded.shape)}")
        return loaded.float().reshape(1, 1).expand(rows, 1)
    if layout == "channel":
        return loaded.float().reshape(-1, 1)
    if loaded.dim() != 2:
        raise ValueError(f"fp8 block scale of shape {tuple(loaded.shape)}: expected [N / block, K / block]")
    return block_scales_to_rows(loaded, loaded.shape[0] * block_rows, block_rows)


def _fp8_param(shape: torch.Size | tuple[int, ...], device: torch.device, loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _scale_param(shape: tuple[int, ...], device: torch.device, loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _groups(k: int, group: int | None) -> int:
    return 1 if group is None else -(-k // group)


def to_fp8_params(layer: nn.Module, layout: ScaleLayout, block: tuple[int, int] | None, scale_name: str) -> None:
    """Before loading a float8 checkpoint: `layer.weight` float8 (same shape, same loader) and a
    scale parameter `scale_name` ([N, 1] or [N, G]) whose loader takes the checkpoint's scale.
    A linear layer or an expert stack (`ExpertGateUp` / `ExpertDown`)."""
    group = block[1] if block is not None else None
    block_rows = block[0] if block is not None else 1
    weight = layer.weight
    k = weight.shape[-1]
    lead = tuple(weight.shape[:-1])
    weight_loader = weight.weight_loader  # type: ignore[attr-defined]
    if isinstance(layer, (ColumnParallelLinear, ExpertGateUp)):
        # Output rows are sharded: spread the scale over the full rows, then the layer's loader slices it.
        upper = (layer.out_per_rank * layer.tp_size) if isinstance(layer, ColumnParallelLinear) else (
            layer.inter_per_rank * get_tp_info().size)  # fmt: skip

        def load_scale(param: nn.Parameter, loaded: torch.Tensor, part: str | int | None = None) -> None:
            rows = scale_rows(loaded, layout, upper, block_rows)
            weight_loader(param, rows) if part is None else weight_loader(param, rows, part)

        groups = _groups(k, group)
    elif isinstance(layer, (RowParallelLinear, ExpertDown)):
        # Input columns are sharded: each rank takes its K-groups of the scale.
        per_rank = layer.in_per_rank if isinstance(layer, RowParallelLinear) else layer.inter_per_rank
        if group is not None and get_tp_info().size > 1 and per_rank % group:
            raise ValueError(f"fp8 blocks of {group} columns straddle the {per_rank} input columns of a rank: "
                             "use a tensor-parallel size that divides the blocks")  # fmt: skip
        groups = _groups(k, group)
        rank = layer.tp_rank

        def load_scale(param: nn.Parameter, loaded: torch.Tensor, part: str | int | None = None) -> None:
            rows = scale_rows(loaded, layout, lead[-1], block_rows)[: lead[-1]]
            if group is not None and rows.shape[1] != groups:
                rows = rows.narrow(1, rank * groups, groups)
            dst = param.data if part is None else param.data[_expert_index(part)]
            if dst.shape != rows.shape:
                raise ValueError(f"fp8 scale: parameter {tuple(dst.shape)} vs checkpoint {tuple(rows.shape)}")
            dst.copy_(rows)

    else:
        raise TypeError(f"no float8 weights for {type(layer).__name__}")
    layer.weight = _fp8_param(weight.shape, weight.device, weight_loader)
    setattr(layer, scale_name, _scale_param((*lead, groups), weight.device, load_scale))


def _expert_index(part: str | int | None) -> int:
    assert isinstance(part, str), "an expert projection is loaded one expert at a time"
    return int(part.split(":")[0])


def finish_linear(layer: ColumnParallelLinear | RowParallelLinear, scale_name: str, group: int | None,
                  impl: Fp8Impl) -> None:  # fmt: skip
    """After loading: the layer computes through `Fp8LinearFn` over its loaded float8 weight."""
    scale = getattr(layer, scale_name).data
    delattr(layer, scale_name)
    layer.use_weight_fn(Fp8LinearFn(layer.weight.data, scale, group, impl), sharded=True)


def quantize_linear(layer: ColumnParallelLinear | RowParallelLinear, impl: Fp8Impl,
                    block: tuple[int, int] | None = None) -> None:  # fmt: skip
    """`--quantization fp8` on a loaded float layer: per-channel float8 (scale = row amax / 448);
    with `block` (`fp8_block`), one scale per block of the weight, as a block checkpoint stores it
    (then expanded to the rows, as the loader does for those checkpoints)."""
    if block is None:
        qweight, scale = quantize_fp8(layer.weight.data)
        layer.use_weight_fn(Fp8LinearFn(qweight, scale, None, impl), sharded=True)
        return
    # Each checkpoint part of a fused layer (q | k | v, gate | up) in blocks of its own, as the
    # checkpoint of those parts would hold them.
    weight = layer.weight.data
    parts = layer.parts if isinstance(layer, ColumnParallelLinear) else (None,)
    qweights, scales = [], []
    for part in parts:
        offset, size, _ = layer.part_rows(part) if isinstance(layer, ColumnParallelLinear) else (0, weight.shape[0], 0)
        qweight, blocks = quantize_weight_blocks(weight.narrow(0, offset, size), block)
        qweights.append(qweight)
        scales.append(block_scales_to_rows(blocks, size, block[0]))
    qweight = qweights[0] if len(qweights) == 1 else torch.cat(qweights)
    scale = scales[0] if len(scales) == 1 else torch.cat(scales)
    layer.use_weight_fn(Fp8LinearFn(qweight, scale, block[1], impl), sharded=True)


class Fp8MoeFn:
    """A `MoeFn` over float8 expert stacks with block scales (gate_up [E, 2I, H] with [E, 2I,
    H / g], down [E, H, I] with [E, H, I / g]): the experts' weights are dequantized to the
    activation dtype and computed by `inner` (the reference or the fused Triton MoE). Weight-only:
    the expert activations stay in the model dtype."""

    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 group: int, inner: Callable[..., torch.Tensor] = moe_ref) -> None:  # fmt: skip
        self.gate_up, self.down, self.group, self.inner = gate_up, down, group, inner

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        gate_up = dequantize_fp8(*self.gate_up, self.group).to(hidden.dtype)
        down = dequantize_fp8(*self.down, self.group).to(hidden.dtype)
        return self.inner(hidden, gate_up, down, weights, ids)


def finish_experts(experts: FusedExperts, scale_name: str, group: int) -> None:
    """After loading float8 experts: the layer computes through `Fp8MoeFn`."""
    inner = experts.moe_fn
    parts = []
    for proj in (experts.gate_up_proj, experts.down_proj):
        scale = getattr(proj, scale_name).data
        delattr(proj, scale_name)
        parts.append((proj.weight.data, scale))
    experts.use_moe_fn(Fp8MoeFn(parts[0], parts[1], group, inner))
