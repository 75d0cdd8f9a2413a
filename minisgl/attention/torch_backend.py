"""Native attention over gathered pages: runs everywhere torch runs (CPU and CUDA).

Extend (prefill on top of a cached prefix) runs SDPA per request with a causal offset mask. Decode
does the same on CPU (one query per request, grouped by KV head, no mask): cheaper there than one
batched call over KV gathered into a padded [B, L] block (12 vs 27 ms per layer for 32 requests of
64-640 tokens, measured on the 2-core machine), which is what it does on CUDA, where
one launch beats 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.batch import ForwardBatch
from minisgl.kernels import cpu_attention
from minisgl.kvcache.pool import KVPool


@dataclass
class TorchAttnMeta:
    # decode: slots [B, L] (padding points at the scratch slot), mask [B, 1, 1, L] (True = attend)
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # extend: per request (token start, new tokens, slots of its whole KV, offset causal mask or
    # None, plain causal). A request with no cached prefix is plain causal (SDPA's own, faster
    # path on CPU); one with a prefix needs the offset mask; one new token sees everything.
    extend: list[tuple[int, int, torch.Tensor, torch.Tensor | None, bool]] | None = None
    # decode through the C++ CPU kernel (bf16 on CPU): the batch's rows and sequence lengths
    kernel: tuple[torch.Tensor, torch.Tensor] | None = None


class TorchAttnBackend(BaseAttnBackend):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale
        # bf16 decode on CPU: one C++ call per layer (kernels/cpu_attention.py), built here at
        # engine start; fp32 keeps the per-request SDPA path (the exact-parity mode).
        self.cpu_kernel = False
        if pool.k[0].device.type == "cpu" and pool.dtype == torch.bfloat16:
            self.cpu_kernel = cpu_attention.load() is not None

    def prepare(self, batch: ForwardBatch) -> None:
        meta = TorchAttnMeta()
        table = batch.token_table
        if batch.phase == "decode" and self.cpu_kernel:
            meta.kernel = (batch.rows, batch.seq_lens)
        elif batch.phase == "decode" and table.device.type != "cpu":
            max_len = batch.max_seq_len
            positions = torch.arange(max_len, device=table.device)
            valid = positions.unsqueeze(0) < batch.seq_lens.unsqueeze(1)  # [B, L]
            slots = table[batch.rows, :max_len].long()
            meta.slots = torch.where(valid, slots, self.pool.scratch_slot)
            meta.mask = valid[:, None, None, :]
        else:
            meta.extend = []
            start = 0
            for row, seq_len, ext_len in zip(batch.rows.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
                slots = table[row, :seq_len].long()
                prefix = seq_len - ext_len
                causal = ext_len > 1 and prefix == 0
                if ext_len == 1 or causal:
                    mask = None
                else:
                    q_pos = torch.arange(prefix, seq_len, device=table.device).unsqueeze(1)
                    k_pos = torch.arange(seq_len, device=table.device).unsqueeze(0)
                    mask = k_pos <= q_pos  # [ext, seq]
                meta.extend.append((start, ext_len, slots, mask, causal))
                start += ext_len
        batch.attn_meta = meta

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        assert k is not None and v is not None, "this backend offers no kv_store: it stores k/v itself"
        self.pool.store(layer_id, batch.out_loc, k, v)
        meta: TorchAttnMeta = batch.attn_meta
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        if meta.kernel is not None:
            rows, seq_lens = meta.kernel
            q = q.view(-1, self.num_heads, self.head_dim)
            return cpu_attention.decode_attention(q, k_cache, v_cache, batch.token_table, rows, seq_lens, self.sm_scale)
        if meta.slots is not None:
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        assert meta.extend is not None
        for start, ext_len, slots, mask, causal in meta.extend:
            ki = k_cache.index_select(0, slots).transpose(0, 1)  # [Hkv, S, D]
            vi = v_cache.index_select(0, slots).transpose(0, 1)
            if ext_len == 1:
                # One query: its heads grouped by KV head, [Hkv, G, D] against [Hkv, S, D].
                # 4-D inputs: CPU SDPA takes its flash path (3-D ones fall back to the slower
                # math path, ~2.4x the time for one query in bf16).
                qi = q[start].view(1, self.num_kv_heads, self.group, self.head_dim)
                oi = F.scaled_dot_product_attention(qi, ki[None], vi[None], scale=self.sm_scale)
                out[start] = oi.reshape(self.num_heads, self.head_dim)
                continue
            qi = q[start : start + ext_len].transpose(0, 1)  # [Hq, ext, D]
            if self.group > 1:
                ki = ki.repeat_interleave(self.group, dim=0)
                vi = vi.repeat_interleave(self.group, dim=0)
            oi = F.scaled_dot_product_attention(
                qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal, scale=self.sm_scale
            )[0]
            out[start : start + ext_len] = oi.transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttnMeta) -> torch.Tensor:
        assert meta.slots is not None and meta.mask is not None
        bsz = q.shape[0]
        # index_select, not k_cache[slots]: on CPU, advanced indexing of a large pool with a 2-D
        # index took ~8 ms per layer for 144 slots here, index_select ~5 us.
        flat = meta.slots.reshape(-1)
        shape = (*meta.slots.shape, *k_cache.shape[1:])
        k = k_cache.index_select(0, flat).view(shape)  # [B, L, Hkv, D]
        v = v_cache.index_select(0, flat).view(shape)
        # Group query heads by their KV head: [B, Hkv, G, D] against [B, Hkv, L, D].
        qg = q.view(bsz, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.mask, scale=self.sm_scale
        )
        return out.reshape(bsz, self.num_heads, self.head_dim)
