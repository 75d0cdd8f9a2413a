"""Routed experts (Qwen3-MoE style): a top-k softmax router and every expert's SwiGLU MLP.

Tensor parallelism splits each expert along its intermediate dimension, like the dense MLP: every
rank holds rows [rank * I/tp, (rank + 1) * I/tp) of every expert's gate and up projections and the
matching columns of its down projection, computes partial outputs for all routed tokens and
all-reduces them (as `RowParallelLinear` does). The router is replicated, so every rank routes
identically.

Weights are stacked per expert: gate_up [E, 2 * I/tp, H] (this rank's gate rows, then its up
rows) and down [E, H, I/tp]. Their loaders take one checkpoint expert tensor at a time, with the
part "<expert>:<gate|up|down>"; `expert_stacked_params` maps Hugging Face's per-expert names
(`mlp.experts.<e>.gate_proj.weight`) onto them for the model's `stacked_params`.
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.kernels.impl import KernelImpl, triton_installed
from minisgl.kernels.moe_ref import moe_ref, route_ref
from minisgl.platform import compiles_triton

MoeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_PROJ_INDEX = {"gate": 0, "up": 1}


def select_moe_impl(impl: KernelImpl, device: torch.device) -> Literal["triton", "torch"]:
    """`auto`: the fused Triton kernel on CUDA, the reference elsewhere.

    Unlike the norm/rotary kernels this is not behind --fused-kernels: the reference reads
    the routing on the host (one GEMM pair per hit expert), so it cannot be captured in a CUDA
    graph and is far too slow to serve a 128-expert model; on CUDA the kernel is the serving path.
    The CPU default is the reference because Triton's interpreter is for tests only."""
    if impl == "torch":
        return "torch"
    if impl == "triton" or (compiles_triton(device) and triton_installed()):
        if not triton_installed():
            raise ValueError("impl='triton' was asked for but triton is not installed")
        return "triton"
    return "torch"


def expert_stacked_params(num_experts: int) -> dict[str, tuple[str, str | int]]:
    """Checkpoint-name fragments of every expert's projections -> (stacked parameter, part)."""
    mapping: dict[str, tuple[str, str | int]] = {}
    for expert in range(num_experts):
        mapping[f"experts.{expert}.gate_proj"] = ("experts.gate_up_proj", f"{expert}:gate")
        mapping[f"experts.{expert}.up_proj"] = ("experts.gate_up_proj", f"{expert}:up")
        mapping[f"experts.{expert}.down_proj"] = ("experts.down_proj", f"{expert}:down")
    return mapping


def _parse_part(part: str | int | None, num_experts: int) -> tuple[int, str]:
    assert isinstance(part, str), "an expert projection is loaded one expert at a time"
    expert, proj = part.split(":")
    index = int(expert)
    if not 0 <= index < num_experts:
        raise ValueError(f"checkpoint expert {index} is out of range for {num_experts} experts")
    return index, proj


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class ExpertGateUp(nn.Module):
    """Every expert's gate and up projections, this rank's slice: weight [E, 2 * I/tp, H]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank = tp.rank
        self.num_experts = num_experts
        self.inter_per_rank = divide(intermediate, tp.size, "expert intermediate size")
        self.weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter_per_rank, hidden))
        _set_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str | int | None = None) -> None:
        expert, proj = _parse_part(part, self.num_experts)
        if proj not in _PROJ_INDEX:
            raise ValueError(f"unknown expert projection {proj!r} for gate_up")
        size = self.inter_per_rank
        dst = param.data[expert].narrow(0, _PROJ_INDEX[proj] * size, size)
        _copy(dst, loaded.narrow(0, self.tp_rank * size, size), f"expert {expert} {proj}_proj")


class ExpertDown(nn.Module):
    """Every expert's down projection, this rank's input columns: weight [E, H, I/tp]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank = tp.rank
        self.num_experts = num_experts
        self.inter_per_rank = divide(intermediate, tp.size, "expert intermediate size")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, self.inter_per_rank))
        _set_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str | int | None = None) -> None:
        expert, proj = _parse_part(part, self.num_experts)
        if proj != "down":
            raise ValueError(f"unknown expert projection {proj!r} for down")
        size = self.inter_per_rank
        _copy(param.data[expert], loaded.narrow(1, self.tp_rank * size, size), f"expert {expert} down_proj")


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, K] in the hidden dtype
    ids: torch.Tensor  # [T, K] int64 expert ids, most probable first


RouteFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def select_route_fn(impl: KernelImpl, device: torch.device) -> RouteFn:
    """The routers' top-k: one Triton launch (`kernels/moe_routing.py`) where the fused experts
    run (the torch ops were ~5 launches a layer), the reference elsewhere (`moe_ref.route_ref`)."""
    if select_moe_impl(impl, device) == "torch":
        return route_ref
    # Imported here so the CPU path never imports triton.
    from minisgl.kernels.moe_routing import topk_route

    return topk_route


class TopKRouter(nn.Module):
    """Replicated gate: softmax over all experts in fp32, the top k, renormalised to sum to one
    when `norm_topk_prob`, cast back to the hidden dtype (Hugging Face's numerics)."""

    def __init__(
        self, num_experts: int, hidden: int, top_k: int, norm_topk_prob: bool, impl: KernelImpl = "auto",
    ) -> None:  # fmt: skip
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self._route = select_route_fn(impl, self.weight.device)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = F.linear(hidden, self.weight)
        weights, ids = self._route(logits, self.top_k, softmax_first=True, renormalize=self.norm_topk_prob)
        return Routing(weights, ids)


class FusedExperts(nn.Module):
    """All experts of one layer; the implementation (Triton kernel or reference) is chosen once."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, impl: KernelImpl = "auto") -> None:
        super().__init__()
        self.gate_up_proj = ExpertGateUp(num_experts, hidden, intermediate)
        self.down_proj = ExpertDown(num_experts, hidden, intermediate)
        self.impl = select_moe_impl(impl, self.gate_up_proj.weight.device)
        self._fn: MoeFn = moe_ref
        if self.impl == "triton":
            # Imported here so the CPU path never imports triton.
            from minisgl.kernels.moe import fused_moe

            self._fn = fused_moe

    @property
    def moe_fn(self) -> MoeFn:
        return self._fn

    def use_moe_fn(self, fn: MoeFn) -> None:
        """At load, once: `fn` computes the experts over weights it holds (float8 blocks: layers/fp8.py)."""
        self._fn = fn

    def forward(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = self._fn(hidden, self.gate_up_proj.weight, self.down_proj.weight, routing.weights, routing.ids)
        return all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router + experts in place of a decoder layer's dense MLP: [T, H] -> [T, H]."""

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, norm_topk_prob: bool,
        impl: KernelImpl = "auto",
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate = TopKRouter(num_experts, hidden, top_k, norm_topk_prob, impl)
        self.experts = FusedExperts(num_experts, hidden, intermediate, impl)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))
