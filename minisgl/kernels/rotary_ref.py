"""Plain-torch neox rotary (rotate halves), optionally after Qwen3's per-head q/k RMSNorm: the
oracle for `kernels/rotary.py` (same argument order) and the CPU path.

`cos`/`sin` are the fp32 tables [max_positions, D/2]; rows are gathered by position and cast to
q's dtype before use, and each product and the sum round to that dtype, as in Hugging Face.
"""

from __future__ import annotations

import torch

from minisgl.kernels.norm_ref import rms_norm_ref


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)
    sin = torch.cat([sin, sin], dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _finish(
    q: torch.Tensor, k: torch.Tensor, q_new: torch.Tensor, k_new: torch.Tensor, inplace: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if not inplace:
        return q_new, k_new
    q.copy_(q_new)
    k.copy_(k_new)
    return q, k


def rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (any strides), positions [T] -> rotated (q, k)."""
    cos_t = cos[positions].to(q.dtype).unsqueeze(1)
    sin_t = sin[positions].to(q.dtype).unsqueeze(1)
    return _finish(q, k, _rotate(q, cos_t, sin_t), _rotate(k, cos_t, sin_t), inplace)


def qk_norm_rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (weights [D]), then rotary: Qwen3's attention prologue."""
    q_new, k_new = rotary_ref(positions, rms_norm_ref(q, q_weight, q_eps), rms_norm_ref(k, k_weight, k_eps), cos, sin)
    return _finish(q, k, q_new, k_new, inplace)
