from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from minisgl.attention.base import KVStore
from minisgl.kernels.impl import KernelImpl, resolve_impl
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref
from minisgl.layers.norm import RMSNorm

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32) and the attention-scaling factor applied to cos/sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, base, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope, yarn)")


def _yarn(dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (GPT-OSS, DeepSeek), as transformers computes it: frequencies below the
    `beta_slow` rotations over the original context are interpolated by `factor`, those above
    `beta_fast` kept, a linear ramp between; cos/sin scaled by `attention_factor` (default
    0.1 ln(factor) + 1, or DeepSeek's ratio of two such terms with `mscale` / `mscale_all_dim`).
    `truncate` (default on) rounds the ramp's ends outward to whole dimensions."""
    if "original_max_position_embeddings" not in scaling or "factor" not in scaling:
        raise ValueError(f"yarn rope_scaling needs factor and original_max_position_embeddings: {scaling}")
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])  # config_families fills it in when the config leaves it out

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attn_factor = mscale_of(factor, float(mscale)) / mscale_of(factor, float(mscale_all))
        else:
            attn_factor = mscale_of(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    # transformers' order of operations, so the table matches it to the last bit
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


def _angles(rotary_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """The rotation angles [max_positions, rotary_dim / 2] (fp32) and the cos/sin factor.

    LongRoPE (Phi-3): positions below `original_max_position_embeddings` use the short factors,
    later ones the long factors; Hugging Face switches on the whole sequence's length instead,
    which is the same thing for a prompt within the original length (decode past it turns long
    at the same position) and differs only for prompts longer than it, where transformers rotates
    every position, cached ones included, with the long factors: a per-position table keeps the
    KV cache (and prefix sharing) valid."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind != "longrope":
        inv_freq, attn_factor = _inv_freq(rotary_dim, base, scaling)
        return torch.outer(positions, inv_freq), attn_factor
    assert scaling is not None
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        attn_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != rotary_dim // 2:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, rotary dim {rotary_dim} needs {rotary_dim // 2}")
        tables.append(torch.outer(positions, 1.0 / (ext * base**shape)))
    short, long = tables
    return torch.where((positions < original).unsqueeze(1), short, long), float(attn_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a cos/sin table indexed by position;
    with `rotary_dim` < head_dim (partial rotary, Phi-4-mini) only the first `rotary_dim` dims of
    each head rotate, through the plain-torch reference.

    The implementation is chosen once here from the table's device (`kernels.impl`): one Triton
    launch for q and k on CUDA (fused with Qwen3's q/k norms in `forward_qk_norm`), a C++ kernel
    on CPU in bf16, the plain-torch reference otherwise."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None,
        impl: KernelImpl = "auto",
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.partial = self.rotary_dim < head_dim
        assert self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= head_dim, (self.rotary_dim, head_dim)
        freqs, attn_factor = _angles(self.rotary_dim, max_positions, base, scaling)
        # The table stays fp32 (a buffer, not a parameter) and is cast at use.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attn_factor, persistent=False)
        self.impl = resolve_impl(impl, self.cos.device) if not self.partial else "torch"
        self._rotary: RotaryFn = rotary_ref
        self._qk_norm_rotary: RotaryFn = qk_norm_rotary_ref
        self._rotary_store_kv: Callable[..., torch.Tensor] | None = None
        if self.impl == "triton":
            # Imported here so the CPU path never imports triton.
            from minisgl.kernels.rotary import qk_norm_rotary, rotary, rotary_store_kv

            self._rotary, self._qk_norm_rotary = rotary, qk_norm_rotary
            self._rotary_store_kv = rotary_store_kv
        elif self.impl == "cpu":
            from minisgl.kernels import cpu_ops

            self._rotary, self._qk_norm_rotary = cpu_ops.rotary, cpu_ops.qk_norm_rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] (views of a fused qkv buffer are fine) -> new tensors."""
        if self.partial:
            dim = self.rotary_dim
            q_rot, k_rot = self._rotary(positions, q[..., :dim], k[..., :dim], self.cos, self.sin)
            return torch.cat([q_rot, q[..., dim:]], dim=-1), torch.cat([k_rot, k[..., dim:]], dim=-1)
        return self._rotary(positions, q, k, self.cos, self.sin)

    def forward_qk_norm(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(positions, q_norm(q), k_norm(k))` (Qwen3's per-head norms), one launch on CUDA."""
        if self.partial:
            return self.forward(positions, q_norm(q), k_norm(k))
        return self._qk_norm_rotary(
            positions, q, k, self.cos, self.sin, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps
        )

    @property
    def stores_kv(self) -> bool:
        """Whether `forward_store` is one fused kernel (Triton); elsewhere it is not offered."""
        return self._rotary_store_kv is not None and not self.partial

    def forward_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        store: KVStore,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
        row_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """`forward` (or `forward_qk_norm` with `norms`) that writes the rotated k, and v, into the
        layer cache slots of `store` in the same launch (no separate KV store); returns q.
        `row_norm` = (hidden, eps): q, k, v came from the un-normalised hidden rows (see
        `kernels.rotary.rotary_store_kv`)."""
        assert self._rotary_store_kv is not None, "only the Triton implementation stores k/v (see stores_kv)"
        eps = (norms[0].weight, norms[1].weight, norms[0].eps, norms[1].eps) if norms is not None else None
        return self._rotary_store_kv(
            positions, q, k, v, self.cos, self.sin, store.k_cache, store.v_cache, store.out_loc, eps, row_norm
        )
