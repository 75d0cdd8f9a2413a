"""GPT-OSS's routed experts: a router with a bias whose softmax runs over the top-k logits, and
experts with biases and the clamped SwiGLU (`kernels/swiglu_moe_ref.py`).

Parameters keep the checkpoint's names (`mlp.router.{weight,bias}`, `mlp.experts.gate_up_proj`,
`gate_up_proj_bias`, `down_proj`, `down_proj_bias`), in minisgl's layout: gate_up [E, 2 * I/tp, H]
(this rank's gate rows, then its up rows), down [E, H, I/tp]. Their loaders take transformers'
layout (gate_up [E, H, 2I] with gate and up interleaved column by column, down [E, I, H]) or the
shipped MXFP4 pair (`*_blocks` + `*_scales`, [E, out, in / 32, ...], through the `blocks` /
`scales` parts), which they dequantize at load (`kernels/mxfp4.py`). With `mxfp4` and the fused
Triton kernel (CUDA), the pair stays 4-bit on the device instead, as parameters named as the
checkpoint's (`experts.gate_up_proj_blocks` [E, 2 * I/tp, H / 2], `..._scales` [E, 2 * I/tp, H / 32],
`experts.down_proj_blocks` [E, H, I/tp / 2], `..._scales`), dequantized tile by tile in the kernel.

Tensor parallelism splits the intermediate dimension as `layers/moe.py` does; the down bias is
added by rank 0 only, ahead of the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.kernels.impl import KernelImpl
from minisgl.kernels.mxfp4 import dequantize_mxfp4
from minisgl.kernels.swiglu_moe_ref import swiglu_moe_ref
from minisgl.layers.moe import Routing, select_moe_impl, select_route_fn

SwigluMoeFn = Callable[..., torch.Tensor]
# Checkpoint suffixes of the MXFP4 pair -> (parameter, part), for a model's `stacked_params`.
MXFP4_STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    f"{proj}_{part}": (proj, part) for proj in ("gate_up_proj", "down_proj") for part in ("blocks", "scales")
}


class BiasedTopKRouter(nn.Module):
    """Replicated router: logits = W x + b, the top k of them, softmaxed among themselves (in the
    logits' dtype, as transformers' GptOssTopKRouter)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, impl: KernelImpl = "auto") -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self._route = select_route_fn(impl, self.weight.device)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = F.linear(hidden, self.weight, self.bias)
        weights, ids = self._route(logits, self.top_k, softmax_first=False)
        return Routing(weights, ids)


class SwigluExperts(nn.Module):
    """Every expert's projections and biases, this rank's slice of the intermediate dimension.
    `mxfp4`: the checkpoint ships MXFP4 experts; they stay 4-bit where the fused kernel serves and
    the rank's slice holds whole 32-input scale groups (else they are dequantized at load)."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, limit: float, alpha: float,
        impl: KernelImpl = "auto", mxfp4: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        tp = get_tp_info()
        self.tp_rank = tp.rank
        self.num_experts = num_experts
        self.inter = intermediate
        self.inter_per_rank = size = divide(intermediate, tp.size, "expert intermediate size")
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.impl = select_moe_impl(impl, self.gate_up_proj_bias.device)
        self.mxfp4 = mxfp4 and self.impl == "triton" and hidden % 32 == 0 and size % 32 == 0
        if self.mxfp4:
            self.gate_up_proj_blocks = _bytes(num_experts, 2 * size, hidden // 2)
            self.gate_up_proj_scales = _bytes(num_experts, 2 * size, hidden // 32, scales=True)
            self.down_proj_blocks = _bytes(num_experts, hidden, size // 2)
            self.down_proj_scales = _bytes(num_experts, hidden, size // 32, scales=True)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * size, hidden))
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, size))
        for param in self.parameters(recurse=False):
            param.weight_loader = self._load  # type: ignore[attr-defined]
        # An MXFP4 pair's first half, until the other arrives: {parameter id: {part: tensor}}.
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._fn: SwigluMoeFn = swiglu_moe_ref
        self._packed: Callable[[torch.Tensor, torch.Tensor], object] | None = None  # MXFP4 weights' type
        if self.impl == "triton":
            # Imported here so the CPU path never imports triton.
            from minisgl.kernels.swiglu_moe import Mxfp4Weights, swiglu_moe

            self._fn, self._packed = swiglu_moe, Mxfp4Weights

    @torch.no_grad()
    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str | int | None = None) -> None:
        if part in ("blocks", "scales"):
            pending = self._pending.setdefault(id(param), {})
            pending[str(part)] = loaded
            if len(pending) < 2:
                return
            del self._pending[id(param)]
            # [E, out, in] one expert at a time (a whole layer's fp32 intermediates would be GBs),
            # on the parameter's device (a GPU dequantizes the 20B model's experts in seconds).
            blocks, scales = pending["blocks"].to(param.device), pending["scales"].to(param.device)
            dense = torch.stack([dequantize_mxfp4(blocks[e], scales[e], param.dtype) for e in range(blocks.shape[0])])
            self._copy_dense(param, dense)
            return
        assert part is None, part
        if self.mxfp4:
            self._load_mxfp4(param, loaded)
        elif param is self.gate_up_proj or param is self.down_proj:
            self._copy_dense(param, loaded.transpose(1, 2))  # transformers' [E, in, out]
        elif param is self.gate_up_proj_bias:
            self._copy(param, self._gate_up_rows(loaded, dim=1), "gate_up_proj_bias")
        else:
            self._copy(param, loaded, "down_proj_bias")

    def _load_mxfp4(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint's blocks [E, out, in / 32, 16] or scales [E, out, in / 32], kept as they are:
        gate_up's rows de-interleaved and sliced like dense rows, down's inputs sliced by whole groups."""
        if param is self.gate_up_proj_bias:
            self._copy(param, self._gate_up_rows(loaded, dim=1), "gate_up_proj_bias")
        elif param is self.down_proj_bias:
            self._copy(param, loaded, "down_proj_bias")
        else:
            packed = loaded.flatten(-2) if param is self.gate_up_proj_blocks or param is self.down_proj_blocks else loaded
            if param is self.gate_up_proj_blocks or param is self.gate_up_proj_scales:
                self._copy(param, self._gate_up_rows(packed, dim=1), "gate_up_proj (MXFP4)")
            else:  # a rank's inputs: size / 2 bytes, size / 32 scales
                width = param.shape[2]
                self._copy(param, packed.narrow(2, self.tp_rank * width, width), "down_proj (MXFP4)")

    def _copy_dense(self, param: nn.Parameter, dense: torch.Tensor) -> None:
        """A projection in the [E, out, in] layout (gate_up's rows interleaved gate / up)."""
        if param is self.gate_up_proj:
            self._copy(param, self._gate_up_rows(dense, dim=1), "gate_up_proj")
        else:
            size = self.inter_per_rank
            self._copy(param, dense.narrow(2, self.tp_rank * size, size), "down_proj")

    def _gate_up_rows(self, interleaved: torch.Tensor, dim: int) -> torch.Tensor:
        """Interleaved gate / up rows along `dim` -> this rank's gate rows, then its up rows."""
        if interleaved.shape[dim] != 2 * self.inter:
            raise ValueError(f"gate_up has {interleaved.shape[dim]} rows, the config says {2 * self.inter}")
        size, start = self.inter_per_rank, self.tp_rank * self.inter_per_rank
        pairs = interleaved.unflatten(dim, (self.inter, 2))  # (gate, up) of each intermediate unit
        parts = [pairs.select(dim + 1, i).narrow(dim, start, size) for i in (0, 1)]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def _copy(param: nn.Parameter, src: torch.Tensor, what: str) -> None:
        if param.shape != src.shape:
            raise ValueError(f"experts.{what}: parameter {tuple(param.shape)} vs checkpoint {tuple(src.shape)}")
        param.data.copy_(src)

    def forward(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        return all_reduce(self.partial(hidden, routing))

    def partial(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's share of the output (what the all-reduce sums)."""
        down_bias = self.down_proj_bias if self.tp_rank == 0 else None
        if self.mxfp4:
            assert self._packed is not None
            w13: object = self._packed(self.gate_up_proj_blocks, self.gate_up_proj_scales)
            w2: object = self._packed(self.down_proj_blocks, self.down_proj_scales)
        else:
            w13, w2 = self.gate_up_proj, self.down_proj
        return self._fn(
            hidden, w13, self.gate_up_proj_bias, w2, down_bias, routing.weights, routing.ids, self.limit, self.alpha,
        )  # fmt: skip


def _bytes(*shape: int, scales: bool = False) -> nn.Parameter:
    """A uint8 parameter for MXFP4 codes or scales. Dummy weights (benchmarks) fill it with random
    codes, or scales of 2^-8 .. 2^-6, which give values of bf16 weights' usual size."""
    param = nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

    def dummy_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        low, high = (119, 122) if scales else (0, 256)
        tensor.copy_(torch.randint(low, high, tensor.shape, generator=generator, device=tensor.device))

    param.dummy_init = dummy_init  # type: ignore[attr-defined]
    return param


class GptOssMoeBlock(nn.Module):
    """Router + experts in place of the dense MLP: [T, H] -> [T, H]."""

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, limit: float, alpha: float,
        impl: KernelImpl = "auto", mxfp4: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.router = BiasedTopKRouter(num_experts, hidden, top_k, impl)
        self.experts = SwigluExperts(num_experts, hidden, intermediate, limit, alpha, impl, mxfp4)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))
