from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from minisgl.kernels.impl import KernelImpl, resolve_impl
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AddNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as Hugging Face does, with an optional fused residual add.

    The implementation is chosen once here from the weight's device (`kernels.impl`): one Triton
    launch on CUDA, a C++ kernel on CPU in bf16, the plain-torch reference (HF's exact math) in
    fp32 on CPU."""

    def __init__(self, size: int, eps: float, impl: KernelImpl = "auto") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.impl = resolve_impl(impl, self.weight.device)
        self._norm: NormFn = rms_norm_ref
        self._add_norm: AddNormFn = fused_add_rms_norm_ref
        if self.impl == "triton":
            # Imported here so the CPU path never imports triton.
            from minisgl.kernels.norm import fused_add_rms_norm, rms_norm

            self._norm, self._add_norm = rms_norm, fused_add_rms_norm
        elif self.impl == "cpu":
            from minisgl.kernels import cpu_ops

            self._norm, self._add_norm = cpu_ops.rms_norm, cpu_ops.fused_add_rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x); with `residual`, (RMSNorm(x + residual), x + residual) as new tensors."""
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)


class TorchNorm(nn.Module):
    """A plain-torch norm taking a residual as `RMSNorm` does: `normalize(x)`, or with `residual`,
    (normalize(x + residual), x + residual). Subclasses give `normalize`."""

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.normalize(x)
        total = x + residual
        return self.normalize(total), total


class GemmaRMSNorm(TorchNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, and, unlike Llama's, the
    product with (1 + weight) is taken in fp32 before the cast back (Hugging Face's math). The
    plain-torch path only; with `residual`, (norm(x + residual), x + residual)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)
