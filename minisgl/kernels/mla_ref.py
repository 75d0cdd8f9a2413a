"""Plain-torch multi-head latent attention decode: the oracle of `kernels/attention/mla_decode.py`
and the CPU path.

Absorbed form: each head's query is already in latent space (q_nope @ W_uk, then its rotated
rope part), so every head attends over the same cached vectors, the latent (its first
`kv_lora_rank` values) serving as the value."""

from __future__ import annotations

import torch


def mla_decode_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """q [B, H, L + R]; cache [slots, L + R] -> [B, H, L].

    Request b attends over slots token_table[rows[b], :seq_lens[b]]: softmax(q k^T * scale) in
    fp32, then the probabilities (in q's dtype) times the latents. A request of length 0 (a
    padding entry) gets zeros."""
    out = q.new_zeros(q.shape[0], q.shape[1], kv_lora_rank)
    for b, (row, seq_len) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
        if seq_len == 0:
            continue
        kv = cache.index_select(0, token_table[row, :seq_len].long()).to(q.dtype)  # [S, L + R]
        scores = torch.matmul(q[b], kv.t()) * sm_scale  # [H, S]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[b] = torch.matmul(probs, kv[:, :kv_lora_rank])
    return out
