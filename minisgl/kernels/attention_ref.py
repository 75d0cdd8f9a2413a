"""Plain-torch paged attention: the oracle for `kernels/attention.py`, same argument order.

Loops over requests on the host (it reads lengths with `.tolist()`), gathers each request's K/V
through the token table and runs softmax in fp32. Clear rather than fast. `window` (a query at
position p sees keys in (p - window, p]) and `softcap` (`cap * tanh(scores / cap)`) are the
kernels' sliding-window and soft-cap variants; None: off. `sinks` [Hq] (attention sinks: a
logit per q head in the softmax denominator, with no value) likewise.
"""

from __future__ import annotations

import torch


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, token_table: torch.Tensor, row: int, seq_len: int, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of positions [0, seq_len) of one request, kv heads repeated to [seq_len, Hq, D] in fp32."""
    slots = token_table[row, :seq_len].long()
    group = num_heads // k_cache.shape[1]
    k = k_cache[slots].float().repeat_interleave(group, dim=1)
    v = v_cache[slots].float().repeat_interleave(group, dim=1)
    return k, v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [E, Hq, D] at positions prefix_len + i; k, v [S, Hq, D]; causal. Returns fp32 [E, Hq, D]."""
    scores = torch.einsum("ehd,shd->hes", q.float(), k) * sm_scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(q.shape[0], device=q.device) + prefix_len
    kv_pos = torch.arange(k.shape[0], device=q.device)
    hidden = kv_pos[None, :] > q_pos[:, None]
    if window is not None:
        hidden |= kv_pos[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hes,shd->ehd", torch.softmax(scores, dim=-1), v)
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hes,shd->ehd", probs, v)


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D]: request i's new tokens sit at extend_starts[i] and see positions <= their own."""
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    for row, seq_len, extend_len, start in zip(
        rows.tolist(), seq_lens.tolist(), extend_lens.tolist(), extend_starts.tolist()
    ):
        if extend_len == 0:
            continue
        k, v = _gather_kv(k_cache, v_cache, token_table, row, seq_len, num_heads)
        q_req = q[start : start + extend_len]
        attended = _attend(q_req, k, v, seq_len - extend_len, sm_scale, window, softcap, sinks)
        out[start : start + extend_len] = attended.to(q.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]: one token per request, at position seq_len - 1, seeing the whole sequence
    (or its last `window` positions).

    A request with seq_len 0 (a padded CUDA-graph entry) gets zeros, as the kernel gives."""
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    for i, (row, seq_len) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
        if seq_len == 0:
            continue
        k, v = _gather_kv(k_cache, v_cache, token_table, row, seq_len, num_heads)
        out[i : i + 1] = _attend(q[i : i + 1], k, v, seq_len - 1, sm_scale, window, softcap, sinks).to(q.dtype)
    return out
