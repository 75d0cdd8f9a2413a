"""Plain-torch SiLU-and-mul: the oracle for `kernels/activation.py` and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.norm_ref import rms_scale_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up, each op rounding to x's dtype (as HF)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_row_norm_ref(x: torch.Tensor, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """`silu_and_mul_ref` of x scaled row-wise by 1 / rms(hidden) (rounded to x's dtype): the
    oracle of `activation.silu_and_mul(x, row_norm=(hidden, eps))`."""
    return silu_and_mul_ref((x.float() * rms_scale_ref(hidden, eps)).to(x.dtype))
