"""Multi-head latent attention over the paged latent cache (DeepSeek-V2/V3).

The pool (kvcache/latent_pool.py) holds per token one vector: the normalised KV latent c (L =
kv_lora_rank values) and the rotated shared rope key (R values). `kv_b_proj` ([H * (N + V), L])
maps c to each head's un-rotated key part (W_uk: N rows) and value (W_uv: V rows).

- Decode absorbs the up-projections: q_lat = q_nope @ W_uk (per head, [L]), attention of
  [q_lat, q_rope] over the cached [c, k_rope] with c as the value (kernels/mla_ref.py, or the
  Triton kernel kernels/attention/mla_decode.py on CUDA), and the output through W_uv. Nothing
  per head is materialised for the cached tokens.
- Extend (prefill, chunked prefill, a prefix-cache hit) up-projects: every key of the request,
  the cached prefix included, is rebuilt from its latent (k = [c W_uk, k_rope], v = c W_uv) and
  the new tokens attend causally with SDPA, one request at a time, on CPU and CUDA alike (the
  simplest correct path; Hugging Face computes it the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.batch import ForwardBatch, current_batch
from minisgl.attention.torch_backend import plan_requests
from minisgl.kernels.impl import triton_installed
from minisgl.kernels.mla_ref import mla_decode_ref
from minisgl.kvcache.latent_pool import LatentPool
from minisgl.layers.attention import AttentionLayer
from minisgl.platform import compiles_triton


class LatentAttention(AttentionLayer):
    """One layer's MLA on the engine's latent pool. The engine binds it like any attention layer;
    the backend it binds to only prepares the batch (its `pool` is this layer's cache)."""

    def __init__(self, layer_id: int, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int,
                 v_dim: int, sm_scale: float) -> None:  # fmt: skip
        super().__init__(layer_id, num_heads, 1, kv_lora_rank + rope_dim)
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.nope_dim = nope_dim
        self.v_dim = v_dim
        self.sm_scale = sm_scale
        self.pool: LatentPool | None = None
        self.decode_impl = "torch"

    def bind(self, backend: BaseAttnBackend) -> None:
        super().bind(backend)
        pool = getattr(backend, "pool", None)
        if not isinstance(pool, LatentPool):
            raise ValueError(f"an MLA layer needs the engine's latent pool, the backend holds {type(pool).__name__}")
        if pool.kv_lora_rank != self.kv_lora_rank or pool.rope_dim != self.rope_dim:
            raise ValueError("the latent pool's layout differs from the model's")
        self.pool = pool
        # The Triton kernel on CUDA, and wherever the engine runs the Triton attention backend (on
        # CPU: Triton's interpreter, for tests); the reference otherwise.
        triton_backend = type(backend).__module__ == "minisgl.attention.triton_backend"
        use_triton = triton_installed() and (compiles_triton(pool.latent[0].device) or triton_backend)
        self.decode_impl = "triton" if use_triton else "torch"

    def forward(  # type: ignore[override]
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor
    ) -> torch.Tensor:
        """q_nope [T, H, N], q_rope [T, H, R] (rotated), latent [T, L + R] (normalised c, then
        the rotated k_rope), kv_b_weight [H * (N + V), L] -> [T, H * V]."""
        assert self.pool is not None, "MLA layer not bound to the engine's latent pool"
        batch = current_batch()
        self.pool.store_latent(self.layer_id, batch.out_loc, latent)
        w_kv = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        if batch.phase == "decode":
            out = self._decode(q_nope, q_rope, w_kv, batch)
        else:
            out = self._extend(q_nope, q_rope, w_kv, batch)
        return out.reshape(out.shape[0], self.num_heads * self.v_dim)

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, w_kv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.pool is not None
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]  # [H, N, L], [H, V, L]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        q = torch.cat([q_lat, q_rope], dim=-1)
        cache = self.pool.latent[self.layer_id]
        args = (q, cache, batch.token_table, batch.rows, batch.seq_lens, self.sm_scale, self.kv_lora_rank)
        if self.decode_impl == "triton":
            from minisgl.kernels.attention.mla_decode import mla_decode

            out_lat = mla_decode(*args)
        else:
            out_lat = mla_decode_ref(*args)
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]

    def _extend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, w_kv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.pool is not None
        cache = self.pool.latent[self.layer_id]
        heads, nope, rank = self.num_heads, self.nope_dim, self.kv_lora_rank
        w_flat = w_kv.reshape(-1, rank)
        # Zeros: rows of padding tokens (an eager step padded to a graph size) belong to no request.
        out = q_nope.new_zeros(q_nope.shape[0], heads, self.v_dim)
        for start, ext_len, slots, mask, causal in plan_requests(batch, None):
            kv = cache.index_select(0, slots).to(q_nope.dtype)  # [S, L + R]
            up = F.linear(kv[:, :rank], w_flat).view(-1, heads, nope + self.v_dim)  # [S, H, N + V]
            k_rope = kv[:, None, rank:].expand(-1, heads, -1)
            k = torch.cat([up[..., :nope], k_rope], dim=-1).transpose(0, 1)  # [H, S, N + R]
            v = up[..., nope:].transpose(0, 1)  # [H, S, V]
            end = start + ext_len
            q = torch.cat([q_nope[start:end], q_rope[start:end]], dim=-1).transpose(0, 1)  # [H, ext, N + R]
            oi = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=self.sm_scale
            )[0]
            out[start:end] = oi.transpose(0, 1)
        return out
