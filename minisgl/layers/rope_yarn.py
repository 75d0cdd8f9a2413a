"""YaRN rope scaling (transformers' `_compute_yarn_parameters`): inverse frequencies blended
between interpolated (divided by `factor`) and original ones over a linear ramp of dimensions set
by `beta_fast` / `beta_slow`, and the cos/sin factor (`attention_factor`, else the mscale ratio
DeepSeek configs give, else YaRN's 0.1 ln(factor) + 1)."""

from __future__ import annotations

import math
from typing import Any

import torch


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] (fp32) and the cos/sin factor of YaRN `scaling`."""
    if not scaling.get("factor") or not scaling.get("original_max_position_embeddings"):
        raise ValueError(f"yarn rope_scaling needs factor and original_max_position_embeddings, got {scaling}")
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    attn_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attn_factor is None:
        if mscale and mscale_all_dim:
            attn_factor = _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
        else:
            attn_factor = _mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each dimension's original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)
