"""The torch backend's sliding-window and soft-capped attention against a dense reference on a
hand-built paged KV pool: extend over a cached prefix longer than the window, per-request
decode (CPU) and the padded batched decode (CUDA's path, run here on CPU), with GQA."""

from __future__ import annotations

import pytest
import torch

from minisgl.attention.base import AttnLayerSpec
from minisgl.attention.batch import ForwardBatch
from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMeta
from minisgl.kvcache.pool import KVPool

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 8, 4
SCALE = 0.3


def _setup(seq_lens: list[int], extend_lens: list[int], gen: torch.Generator):  # type: ignore[no-untyped-def]
    pool = KVPool(1, 64, PAGE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    # Each request's slots: a shuffled run of pages, so gathered keys are not contiguous.
    pages = torch.randperm(64, generator=gen)
    table = torch.zeros(len(seq_lens), 64, dtype=torch.int32)
    for row in range(len(seq_lens)):
        mine = pages[row * 16 : (row + 1) * 16]
        pos = torch.arange(64)
        table[row] = (mine[pos // PAGE] * PAGE + pos % PAGE).int()
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    out_loc = torch.cat([table[r, s - e : s] for r, (s, e) in enumerate(zip(seq_lens, extend_lens))]).long()
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    batch = ForwardBatch(
        phase="decode" if all(e == 1 for e in extend_lens) else "extend",
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64),
        positions=torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)]),
        out_loc=out_loc, rows=torch.arange(len(seq_lens)), seq_lens=i32(seq_lens), extend_lens=i32(extend_lens),
        extend_starts=i32(starts), token_table=table, seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens,
        sample_idx=torch.zeros(1, dtype=torch.int64),
    )  # fmt: skip
    n = len(out_loc)
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    return pool, batch, q, k, v


def _reference(pool: KVPool, batch: ForwardBatch, q: torch.Tensor, spec: AttnLayerSpec) -> torch.Tensor:
    """Dense attention per request and head (after the new k/v were stored)."""
    out = torch.empty_like(q)
    start = 0
    for row, seq_len, ext in zip(batch.rows.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
        slots = batch.token_table[row, :seq_len].long()
        keys, values = pool.k[0][slots], pool.v[0][slots]  # [S, Hkv, D]
        for j in range(ext):
            pos = seq_len - ext + j
            visible = torch.arange(seq_len) <= pos
            if spec.sliding_window is not None:
                visible &= torch.arange(seq_len) > pos - spec.sliding_window
            for h in range(HEADS):
                kv = h // (HEADS // KV_HEADS)
                scores = keys[:, kv] @ q[start + j, h] * SCALE
                if spec.logit_cap is not None:
                    scores = torch.tanh(scores / spec.logit_cap) * spec.logit_cap
                probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
                out[start + j, h] = probs @ values[:, kv]
        start += ext
    return out


SPECS = [AttnLayerSpec(), AttnLayerSpec(sliding_window=6), AttnLayerSpec(logit_cap=2.0),
         AttnLayerSpec(sliding_window=5, logit_cap=2.0)]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"w{s.sliding_window}-cap{s.logit_cap}")
@pytest.mark.parametrize("padded", [False, True])
def test_decode(spec: AttnLayerSpec, padded: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    pool, batch, q, k, v = _setup([3, 9, 30], [1, 1, 1], gen)
    backend = TorchAttnBackend(pool, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.configure_layer(0, spec)
    backend.prepare(batch)
    if padded:
        meta = TorchAttnMeta(batch)
        backend.pad_decode(meta)
        batch.attn_meta = meta
    out = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(out, _reference(pool, batch, q, spec), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"w{s.sliding_window}-cap{s.logit_cap}")
def test_extend_over_cached_prefix(spec: AttnLayerSpec) -> None:
    """Requests: a fresh prompt longer than the window, one extending 12 tokens over a 20-token
    prefix, a fresh prompt within the window, and one decode riding along."""
    gen = torch.Generator().manual_seed(2)
    pool, batch, q, k, v = _setup([11, 32, 4, 17], [11, 12, 4, 1], gen)
    backend = TorchAttnBackend(pool, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.configure_layer(0, spec)
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(out, _reference(pool, batch, q, spec), rtol=1e-5, atol=1e-5)
