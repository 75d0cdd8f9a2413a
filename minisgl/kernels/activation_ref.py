"""Plain-torch SiLU-and-mul: the oracle for `kernels/activation.py` and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up, each op rounding to x's dtype (as HF)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
