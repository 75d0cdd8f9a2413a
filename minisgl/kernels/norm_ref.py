"""Plain-torch RMSNorm: the oracle for `kernels/norm.py` (same argument order) and the CPU path.

The math is Hugging Face's, rounding included: normalise in fp32, cast back to the input dtype,
then multiply by the weight in that dtype. fp32 parity with HF (tests/golden) depends on it.
"""

from __future__ import annotations

import torch


def rms_scale_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's RMSNorm factor 1 / rms(x) over the last dim, fp32 [..., 1] (as HF computes it)."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` [..., N]; per-head norm is the same call on [T, H, D]."""
    x32 = x.float()
    return weight * (x32 * rms_scale_ref(x32, eps)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); with `inplace` the results go into x and residual."""
    total = x + residual
    normed = rms_norm_ref(total, weight, eps)
    if not inplace:
        return normed, total
    residual.copy_(total)
    x.copy_(normed)
    return x, residual
