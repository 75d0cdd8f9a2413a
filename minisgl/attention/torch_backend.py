"""Native attention over gathered pages: runs everywhere torch runs (CPU and CUDA).

Extend (prefill on top of a cached prefix) runs SDPA per request with a causal offset mask. Decode
does the same on CPU (one query per request, grouped by KV head, no mask): cheaper there than one
batched call over KV gathered into a padded [B, L] block (12 vs 27 ms per layer for 32 requests of
64-640 tokens, measured on the 2-core machine), which is what it does on CUDA, where
one launch beats 32.

Per layer (`configure_layer`), a sliding window gathers only the keys some query of the step can
still see (the last `window` positions before it, itself included) and masks the rest; a logit
soft-cap (Gemma 2) runs the scores through `cap * tanh(s / cap)` before softmax, which SDPA cannot
do, so those layers take an explicit matmul-softmax-matmul in Hugging Face's order of operations;
so do layers with attention sinks (GPT-OSS: a learned logit per head joins the softmax's
denominator, a column with no value).
Pages that slid out of a window stay in the pool (the prefix cache may share them, and global
layers of the same model read them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttnLayerSpec, BaseAttnBackend
from minisgl.attention.batch import ForwardBatch
from minisgl.kernels import cpu_attention, cpu_extend
from minisgl.kernels.cpp_ext import CpuKernels
from minisgl.kvcache.pool import KVPool

_PLAIN = AttnLayerSpec()


class RequestPlan(NamedTuple):
    """One request of an extend (or CPU decode) step under one window: its first token in T, its
    new tokens, the slots of the keys it reads, the mask over them (True = attend; None: all, or
    plain causal) and whether SDPA's own causal path applies."""

    start: int
    ext_len: int
    slots: torch.Tensor
    mask: torch.Tensor | None
    causal: bool


@dataclass
class TorchAttnMeta:
    batch: ForwardBatch
    # decode on CUDA: slots [B, L] (padding points at the scratch slot), mask [B, 1, 1, L] (True = attend)
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # per-request plans by sliding window (None: global), built on first use by a layer
    plans: dict[int | None, list[RequestPlan]] = field(default_factory=dict)
    # CUDA decode masks narrowed to a window, by window
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # decode through the C++ CPU kernel (bf16 on CPU): the batch's rows and sequence lengths
    kernel: tuple[torch.Tensor, torch.Tensor] | None = None


def plan_requests(batch: ForwardBatch, window: int | None) -> list[RequestPlan]:
    """Each request's keys and mask for a layer with this sliding window (None: global)."""
    table = batch.token_table
    plans, start = [], 0
    for row, seq_len, ext_len in zip(batch.rows.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
        prefix = seq_len - ext_len
        # The first query (position `prefix`) sees keys > prefix - window: nothing before is read.
        first = 0 if window is None else max(0, prefix - window + 1)
        slots = table[row, first:seq_len].long()
        causal = ext_len > 1 and prefix == 0 and (window is None or ext_len <= window)
        mask = None
        if ext_len > 1 and not causal:
            q_pos = torch.arange(prefix, seq_len, device=table.device).unsqueeze(1)
            k_pos = torch.arange(first, seq_len, device=table.device).unsqueeze(0)
            mask = k_pos <= q_pos  # [ext, keys]
            if window is not None:
                mask &= k_pos > q_pos - window
        plans.append(RequestPlan(start, ext_len, slots, mask, causal))
        start += ext_len
    return plans


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
    cap: float | None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v over the last two dims (Gemma 2's eager
    attention, step for step; softmax in fp32). `sinks` (broadcastable to the scores with a last
    dim of 1: one logit per head) joins the softmax as an extra column that is then dropped
    (GPT-OSS's eager attention)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


class TorchAttnBackend(BaseAttnBackend):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale
        self.specs: dict[int, AttnLayerSpec] = {}
        # Decode on CPU: one C++ call per layer (kernels/cpu_attention.py), built here at engine
        # start, for a bf16 model, and for fp32 activations where the kernel config allows it
        # (cpu_kernels_fp32: GGUF weights kept quantized), over fp32, bf16 or fp16 pages; a float
        # fp32 model keeps the per-request SDPA path (the exact-parity mode). Pages narrower than
        # q (fp16 under fp32: kvcache/pool.py) are read into q's dtype on both paths.
        # The library handle is held and called directly: the module wrappers look it up (and
        # check the kernel config) on each call, twice per layer per step.
        self.cpu_lib: CpuKernels | None = None
        if pool.k[0].device.type == "cpu" and cpu_attention.takes(pool.dtype, pool.compute_dtype):
            self.cpu_lib = cpu_attention.load()
        self.cpu_kernel = self.cpu_lib is not None
        self.cpu_extend = self.cpu_kernel and cpu_extend.supports(head_dim)  # prefill: kernels/cpu_extend.py

    def configure_layer(self, layer_id: int, spec: AttnLayerSpec) -> None:
        if not spec.is_plain:
            self.specs[layer_id] = spec

    def prepare(self, batch: ForwardBatch) -> None:
        meta = TorchAttnMeta(batch)
        table = batch.token_table
        if batch.phase == "decode" and self.cpu_kernel:
            meta.kernel = (batch.rows, batch.seq_lens)
        elif batch.phase == "decode" and table.device.type != "cpu":
            self.pad_decode(meta)
        else:
            meta.plans[None] = plan_requests(batch, None)
        batch.attn_meta = meta

    def pad_decode(self, meta: TorchAttnMeta) -> None:
        """Decode as one batched call (CUDA's path): every request's KV gathered into [B, L],
        padding masked out and pointed at the scratch slot."""
        batch, table = meta.batch, meta.batch.token_table
        max_len = batch.max_seq_len
        positions = torch.arange(max_len, device=table.device)
        valid = positions.unsqueeze(0) < batch.seq_lens.unsqueeze(1)  # [B, L]
        slots = table[batch.rows, :max_len].long()
        meta.slots = torch.where(valid, slots, self.pool.scratch_slot)
        meta.mask = valid[:, None, None, :]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        assert k is not None and v is not None, "this backend offers no kv_store: it stores k/v itself"
        self.pool.store(layer_id, batch.out_loc, k, v)
        meta: TorchAttnMeta = batch.attn_meta
        spec = self.specs.get(layer_id, _PLAIN)
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        if meta.kernel is not None and spec.is_plain:
            rows, seq_lens = meta.kernel
            q = q.view(-1, self.num_heads, self.head_dim)
            assert self.cpu_lib is not None
            return self.cpu_lib.decode_attention(q, k_cache, v_cache, batch.token_table, rows, seq_lens, self.sm_scale)
        if self.cpu_extend and spec.is_plain and meta.slots is None:
            return self._extend_kernel(q, k_cache, v_cache, batch)
        # A float8 pool: pages are read in q's dtype unscaled; k's scale joins the softmax scale and
        # v's scales the output (KVPool), which equals attending over the dequantized pages.
        scale, v_scale = self.sm_scale, 1.0
        if self.pool.quantized:
            scale, v_scale = scale * self.pool.k_scale[layer_id], self.pool.v_scale[layer_id]
        if meta.slots is not None:
            out = self._decode(q, k_cache, v_cache, meta, spec, scale)
        else:
            window = spec.sliding_window
            plans = meta.plans.get(window)
            if plans is None:
                plans = meta.plans[window] = plan_requests(batch, window)
            out = self._extend(q, k_cache, v_cache, plans, spec, scale)
        return out if v_scale == 1.0 else out * v_scale

    def _extend_kernel(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """A plain layer's extend in one C++ call, K/V read from the pool in place (kernels/cpu_extend.py)."""
        qh = q.view(-1, self.num_heads, self.head_dim)
        assert self.cpu_lib is not None
        return self.cpu_lib.extend_attention(
            qh, k_cache, v_cache, batch.token_table, batch.rows, batch.seq_lens, batch.extend_lens, self.sm_scale
        ).view(q.shape)

    def _extend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plans: list[RequestPlan],
        spec: AttnLayerSpec, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        cap, sinks = spec.logit_cap, spec.sinks
        explicit = cap is not None or sinks is not None
        for start, ext_len, slots, mask, causal in plans:
            ki = k_cache.index_select(0, slots).to(q.dtype).transpose(0, 1)  # [Hkv, S, D]
            vi = v_cache.index_select(0, slots).to(q.dtype).transpose(0, 1)
            if ext_len == 1:
                # One query: its heads grouped by KV head, [Hkv, G, D] against [Hkv, S, D].
                # 4-D inputs: CPU SDPA takes its flash path (3-D ones fall back to the slower
                # math path, ~2.4x the time for one query in bf16).
                qi = q[start].view(1, self.num_kv_heads, self.group, self.head_dim)
                if not explicit:
                    oi = F.scaled_dot_product_attention(qi, ki[None], vi[None], scale=scale)
                else:
                    grouped = None if sinks is None else sinks.view(1, self.num_kv_heads, self.group, 1)
                    oi = explicit_attention(qi, ki[None], vi[None], None, False, scale, cap, grouped)
                out[start] = oi.reshape(self.num_heads, self.head_dim)
                continue
            qi = q[start : start + ext_len].transpose(0, 1)  # [Hq, ext, D]
            if self.group > 1:
                ki = ki.repeat_interleave(self.group, dim=0)
                vi = vi.repeat_interleave(self.group, dim=0)
            if not explicit:
                oi = F.scaled_dot_product_attention(
                    qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal, scale=scale
                )[0]
            else:
                per_head = None if sinks is None else sinks.view(self.num_heads, 1, 1)
                oi = explicit_attention(qi, ki, vi, mask, causal, scale, cap, per_head)
            out[start : start + ext_len] = oi.transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttnMeta,
        spec: AttnLayerSpec, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        assert meta.slots is not None and meta.mask is not None
        bsz = q.shape[0]
        # index_select, not k_cache[slots]: on CPU, advanced indexing of a large pool with a 2-D
        # index took ~8 ms per layer for 144 slots here, index_select ~5 us.
        flat = meta.slots.reshape(-1)
        shape = (*meta.slots.shape, *k_cache.shape[1:])
        k = k_cache.index_select(0, flat).view(shape).to(q.dtype)  # [B, L, Hkv, D]
        v = v_cache.index_select(0, flat).view(shape).to(q.dtype)
        mask = meta.mask
        window = spec.sliding_window
        if window is not None:
            mask = meta.window_masks.get(window)
            if mask is None:
                positions = torch.arange(meta.slots.shape[1], device=meta.slots.device)
                first = (meta.batch.seq_lens.long() - window).unsqueeze(1)  # [B, 1]
                mask = meta.mask & (positions.unsqueeze(0) >= first)[:, None, None, :]
                meta.window_masks[window] = mask
        # Group query heads by their KV head: [B, Hkv, G, D] against [B, Hkv, L, D].
        qg = q.view(bsz, self.num_kv_heads, self.group, self.head_dim)
        if spec.logit_cap is not None or spec.sinks is not None:
            sinks = None if spec.sinks is None else spec.sinks.view(1, self.num_kv_heads, self.group, 1)
            out = explicit_attention(
                qg, k.transpose(1, 2), v.transpose(1, 2), mask, False, scale, spec.logit_cap, sinks
            )
        else:
            out = F.scaled_dot_product_attention(
                qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
            )
        return out.reshape(bsz, self.num_heads, self.head_dim)
