from __future__ import annotations

import json
import math
import weakref
from typing import Any, Callable

import torch
from torch import nn

from minisgl.attention.base import KVStore
from minisgl.kernels.impl import KernelImpl, resolve_impl
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rope_yarn import yarn_inv_freq

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# One cos/sin table per distinct rope and device, shared by the layers that rotate alike (every
# layer of a model, as a rule): SmolLM2's 30 layers held 30 copies of its 8192-position table,
# 60 MB. Weak values: a table lives as long as a layer holds it (`RotaryEmbedding._table`). Its
# cos/sin views do not keep the table's Python object alive under inference mode (an inference
# tensor's views record no base), and the engine builds its model under inference mode.
_TABLES: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = weakref.WeakValueDictionary()


def _cos_sin_table(rotary_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[2, rows, rotary_dim / 2]: the fp32 cos and sin tables (`_angles`' rows, times its factor)
    on the default device, shared while some layer holds it."""
    key = (rotary_dim, max_positions, base, json.dumps(scaling, sort_keys=True, default=str), str(torch.get_default_device()))
    table = _TABLES.get(key)
    if table is None:
        freqs, attn_factor = _angles(rotary_dim, max_positions, base, scaling)
        table = torch.stack([freqs.cos() * attn_factor, freqs.sin() * attn_factor])
        _TABLES[key] = table
    return table


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
        return yarn_inv_freq(head_dim, base, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope, yarn)")


def _angles(rotary_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """The rotation angles (fp32) and the cos/sin factor: [max_positions, rotary_dim / 2], one
    row per position; LongRoPE adds `original` rows after those (`long_rope_rows`).

    LongRoPE (Phi-3): Hugging Face picks the factor set from the forward's length (the largest
    position + 1): a sequence within `original_max_position_embeddings` rotates with the short
    factors, a longer one with the long factors at every position. With a KV cache that makes a
    decode step's choice per position (short below the original length, long from there, the
    cached keys kept as they were): rows [0, max_positions) hold that per-position table. A
    prompt longer than the original length rotates all its positions with the long factors, the
    ones below the original length included: rows max_positions + p, p < original, hold those
    (positions from `original` on read the shared long rows)."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind != "longrope":
        inv_freq, attn_factor = _inv_freq(rotary_dim, base, scaling)
        return torch.outer(positions, inv_freq), attn_factor
    assert scaling is not None
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    given = scaling.get("attention_factor")
    if given is not None:
        attn_factor = float(given)
    else:
        attn_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freqs = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != rotary_dim // 2:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, rotary dim {rotary_dim} needs {rotary_dim // 2}")
        inv_freqs.append(1.0 / (ext * base**shape))
    short, long = (torch.outer(positions, inv_freq) for inv_freq in inv_freqs)
    per_position = torch.where((positions < original).unsqueeze(1), short, long)
    long_head = torch.outer(positions[: min(original, max_positions)], inv_freqs[1])
    return torch.cat([per_position, long_head]), attn_factor


def long_rope_rows(positions: list[int], long_spans: list[tuple[int, int]], max_positions: int, original: int) -> list[int]:
    """The cos/sin table rows of a batch's `positions` (`_angles`' LongRoPE layout): tokens
    [start, end) of each of `long_spans` belong to a request whose prompt is longer than
    `original`, which rotates every position with the long factors (its positions below
    `original` read rows max_positions + p); every other token reads its own position's row."""
    rows = list(positions)
    for start, end in long_spans:
        for i in range(start, end):
            if rows[i] < original:
                rows[i] += max_positions
    return rows


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
        # The shared table, held so the next layer built finds it (see _TABLES); not a buffer:
        # cos and sin are (views of it), and a state_dict lists them once each.
        self._table = _cos_sin_table(self.rotary_dim, max_positions, base, scaling)
        cos, sin = self._table[0], self._table[1]
        # The table stays fp32 (a buffer, not a parameter) and is cast at use.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
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
            positions, q, k, v, self.cos, self.sin, store.k_cache, store.v_cache, store.out_loc, eps, row_norm,
            (store.k_scale, store.v_scale),
        )
