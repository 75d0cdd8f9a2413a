from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from minisgl.kernels.activation_ref import silu_and_mul_ref, silu_and_mul_row_norm_ref
from minisgl.kernels.impl import KernelImpl, resolve_impl


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up (the plain-torch reference)."""
    return silu_and_mul_ref(x)


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up]: one Triton launch on CUDA, a C++ kernel on CPU in
    bf16, the reference otherwise.

    It has no tensors to tell its device, so it takes the device the model is being built on
    (`torch.device(...)` context, as the engine builds it) unless one is given."""

    def __init__(self, impl: KernelImpl = "auto", device: torch.device | None = None) -> None:
        super().__init__()
        self.impl = resolve_impl(impl, device if device is not None else torch.get_default_device())
        self._fn: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref
        self._row_norm_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = silu_and_mul_row_norm_ref
        if self.impl == "triton":
            # Imported here so the CPU path never imports triton.
            from minisgl.kernels.activation import silu_and_mul as silu_and_mul_triton

            self._fn = silu_and_mul_triton
            self._row_norm_fn = lambda x, hidden, eps: silu_and_mul_triton(x, (hidden, eps))
        elif self.impl == "cpu":
            from minisgl.kernels import cpu_ops

            self._fn = cpu_ops.silu_and_mul

    def forward(self, x: torch.Tensor, row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """silu(gate) * up; with `row_norm` = (hidden, eps), of x scaled row-wise by 1 / rms(hidden)
        first (x was projected from the un-normalised hidden, the norm weight folded in)."""
        if row_norm is None:
            return self._fn(x)
        return self._row_norm_fn(x, *row_norm)


class GeluAndMul(nn.Module):
    """gelu(gate) * up for x = [gate | up] (GeGLU: Gemma's MLP); `approximate` "tanh" is
    transformers' gelu_pytorch_tanh, "none" the exact erf GELU. Plain torch on every device."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate=self.approximate) * up


def make_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation a config's `hidden_act` / `hidden_activation` names."""
    if hidden_act == "silu":
        return SiluAndMul()
    if hidden_act == "gelu_pytorch_tanh":
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported hidden activation {hidden_act!r} (supported: silu, gelu, gelu_pytorch_tanh)")
