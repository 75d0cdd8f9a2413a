"""TritonAttnBackend end to end on a hand-built KVPool and ForwardBatch: a mixed extend step, a
decode step, and a decode "replay" through the CUDA-graph buffers (run eagerly). On CPU the kernels
run in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
# Without CUDA, tests/conftest.py has put triton in interpreter mode before this import.

import minisgl.attention.triton_backend as triton_backend_module  # noqa: E402
from minisgl.attention.batch import ForwardBatch  # noqa: E402
from minisgl.attention.triton_backend import (  # noqa: E402
    TritonDecodeMeta,
    TritonExtendMeta,
    create_triton_backend,
)
from minisgl.kernels.attention import decode_num_splits, is_interpreted  # noqa: E402
from minisgl.kernels.attention_ref import decode_attention_ref, extend_attention_ref  # noqa: E402
from minisgl.kvcache.pool import KVPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
PAGE_SIZE = 4
NUM_LAYERS = 2


class PagedRequests:
    """Requests in table rows with shuffled pages; hands out the slots of new positions."""

    def __init__(self, pool: KVPool, rows: list[int], max_len: int, gen: torch.Generator) -> None:
        self.rows = rows
        self.lens = [0] * len(rows)
        pages_per_row = math.ceil(max_len / PAGE_SIZE)
        page_order = torch.randperm(pool.num_pages, generator=gen)
        self.table = torch.zeros(max(rows) + 1, pages_per_row * PAGE_SIZE, dtype=torch.int32)
        pos = torch.arange(pages_per_row * PAGE_SIZE)
        for i, row in enumerate(rows):
            pages = page_order[i * pages_per_row : (i + 1) * pages_per_row]
            self.table[row] = (pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).int()
        self.table = self.table.to(DEVICE)

    def grow(self, extend_lens: list[int]) -> torch.Tensor:
        """Slots of the next `extend_lens[i]` positions of each request, concatenated."""
        locs = [self.table[row, n : n + e] for row, n, e in zip(self.rows, self.lens, extend_lens)]
        self.lens = [n + e for n, e in zip(self.lens, extend_lens)]
        return torch.cat(locs).long()


def make_batch(reqs: PagedRequests, extend_lens: list[int]) -> ForwardBatch:
    out_loc = reqs.grow(extend_lens)
    seq_lens = reqs.lens
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    positions = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)])

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return ForwardBatch(
        phase="decode" if all(e == 1 for e in extend_lens) else "extend",
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=DEVICE),
        positions=positions.to(DEVICE),
        out_loc=out_loc,
        rows=torch.tensor(reqs.rows, dtype=torch.int64, device=DEVICE),
        seq_lens=i32(seq_lens),
        extend_lens=i32(extend_lens),
        extend_starts=i32(starts),
        token_table=reqs.table,
        seq_lens_cpu=list(seq_lens),
        extend_lens_cpu=list(extend_lens),
        sample_idx=(i32(starts) + i32(extend_lens) - 1).long(),
    )


def reference(pool: KVPool, layer: int, q: torch.Tensor, batch: ForwardBatch, sm_scale: float) -> torch.Tensor:
    cache = (pool.k[layer], pool.v[layer], batch.token_table, batch.rows, batch.seq_lens)
    if batch.phase == "decode":
        return decode_attention_ref(q, *cache, sm_scale)
    return extend_attention_ref(q, *cache, batch.extend_lens, batch.extend_starts, sm_scale)


def random_qkv(num_tokens: int, heads: tuple[int, int], head_dim: int, gen: torch.Generator) -> list[torch.Tensor]:
    num_heads, num_kv_heads = heads
    return [
        torch.randn(num_tokens, h, head_dim, generator=gen).to(DEVICE)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    ]


# The embedded model's per-rank heads (non-power-of-two counts), and a long prefix with one kv head
# so decode splits the sequence (the interpreter pretends to have 4 SMs).
@pytest.mark.parametrize("heads,head_dim,long_prefix", [((9, 3), 64, 40), ((4, 1), 128, 141)])
def test_extend_then_decode_match_reference(heads: tuple[int, int], head_dim: int, long_prefix: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads = heads
    pool = KVPool(NUM_LAYERS, 256, PAGE_SIZE, num_kv_heads, head_dim, torch.float32, DEVICE)
    backend = create_triton_backend(pool, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    reqs = PagedRequests(pool, rows=[3, 0, 5], max_len=160, gen=gen)

    # A cached prefix (two requests; the first has none), written as an earlier step would have.
    prefix_loc = reqs.grow([0, 6, long_prefix])
    for layer in range(NUM_LAYERS):
        pool.store(layer, prefix_loc, *random_qkv(len(prefix_loc), heads, head_dim, gen)[1:])

    # Mixed extend: a fresh prompt, a one-token extend, a chunk on top of a long prefix.
    batch = make_batch(reqs, [7, 1, 12])
    backend.prepare(batch)
    meta = batch.attn_meta
    assert isinstance(meta, TritonExtendMeta) and meta.max_extend_len == 12
    # The one-token request takes the decode kernel; the other two the extend kernel.
    assert meta.split is not None and meta.split.token_idx.tolist() == [7]
    assert meta.split.rows.tolist() == [3, 5] and meta.split.decode.rows.tolist() == [0]
    for layer in range(NUM_LAYERS):
        q, k, v = random_qkv(batch.num_tokens, heads, head_dim, gen)
        out = backend.forward(q, k, v, layer, batch)
        assert out.shape == (batch.num_tokens, num_heads, head_dim)
        assert torch.equal(pool.k[layer][batch.out_loc], k) and torch.equal(pool.v[layer][batch.out_loc], v)
        torch.testing.assert_close(out, reference(pool, layer, q, batch, backend.sm_scale), atol=1e-4, rtol=1e-4)

    batch = make_batch(reqs, [1, 1, 1])
    backend.prepare(batch)
    meta = batch.attn_meta
    assert isinstance(meta, TritonDecodeMeta)
    assert meta.launch.num_splits == decode_num_splits(3, num_kv_heads, head_dim, long_prefix + 13, DEVICE)
    for layer in range(NUM_LAYERS):
        q, k, v = random_qkv(batch.num_tokens, heads, head_dim, gen)
        out = backend.forward(q, k, v, layer, batch)
        torch.testing.assert_close(out, reference(pool, layer, q, batch, backend.sm_scale), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("extend_lens", [[1, 5, 1, 1, 9, 1], [1, 1, 1], [6, 3]])
def test_mixed_steps_split_between_kernels(extend_lens: list[int]) -> None:
    """Decodes riding along prefill chunks (and an extend-phase batch of one-token rows only, and
    one without any) give the reference's attention for every row."""
    gen = torch.Generator().manual_seed(len(extend_lens))
    heads, head_dim = (6, 2), 64
    pool = KVPool(1, 512, PAGE_SIZE, heads[1], head_dim, torch.float32, DEVICE)
    backend = create_triton_backend(pool, *heads, head_dim, 0.125)
    rows = [7 - i for i in range(len(extend_lens))]
    reqs = PagedRequests(pool, rows=rows, max_len=120, gen=gen)
    prefix_loc = reqs.grow([5 + 17 * i for i in range(len(extend_lens))])
    pool.store(0, prefix_loc, *random_qkv(len(prefix_loc), heads, head_dim, gen)[1:])
    batch = make_batch(reqs, extend_lens)
    batch.phase = "extend"  # as the engine marks any step that is not a pure graph decode
    backend.prepare(batch)
    meta = batch.attn_meta
    assert isinstance(meta, TritonExtendMeta)
    assert (meta.split is None) == (1 not in extend_lens)
    q, k, v = random_qkv(batch.num_tokens, heads, head_dim, gen)
    out = backend.forward(q, k, v, 0, batch)
    expected = extend_attention_ref(q, pool.k[0], pool.v[0], batch.token_table, batch.rows, batch.seq_lens,
                                    batch.extend_lens, batch.extend_starts, 0.125)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_graph_buffers_replay_smaller_batch() -> None:
    """Capture metadata at bs 4, then replay a bs-3 decode (padded to 4) through the same static
    buffers."""
    gen = torch.Generator().manual_seed(1)
    heads, head_dim = (4, 2), 64
    pool = KVPool(1, 64, PAGE_SIZE, heads[1], head_dim, torch.float32, DEVICE)
    backend = create_triton_backend(pool, *heads, head_dim, 0.125)
    backend.init_graph_state(max_bs=4)
    reqs = PagedRequests(pool, rows=[1, 2, 0], max_len=60, gen=gen)
    prefix_loc = reqs.grow([40, 3, 17])
    pool.store(0, prefix_loc, *random_qkv(len(prefix_loc), heads, head_dim, gen)[1:])

    # What a graph runner captures with: its own static batch, padded entries on the scratch slot.
    scratch = torch.full((4,), pool.scratch_slot, dtype=torch.int64, device=DEVICE)
    capture = ForwardBatch(
        phase="decode",
        input_ids=torch.zeros(4, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(4, dtype=torch.int64, device=DEVICE),
        out_loc=scratch.clone(),
        rows=torch.zeros(4, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.ones(4, dtype=torch.int32, device=DEVICE),
        extend_lens=torch.ones(4, dtype=torch.int32, device=DEVICE),
        extend_starts=torch.arange(4, dtype=torch.int32, device=DEVICE),
        token_table=reqs.table,
        seq_lens_cpu=[1] * 4,
        extend_lens_cpu=[1] * 4,
        sample_idx=torch.arange(4, device=DEVICE),
    )
    backend.prepare_for_capture(capture)
    captured = capture.attn_meta
    assert isinstance(captured, TritonDecodeMeta)
    assert captured.launch.num_splits == decode_num_splits(4, heads[1], head_dim, None, DEVICE)

    live = make_batch(reqs, [1, 1, 1])
    # What the runner does before a replay: the live batch into its static buffers (the captured
    # metadata reads them), the padding entry at seq_len 0, then the backend's order.
    capture.out_loc[:3] = live.out_loc
    capture.rows[:3] = live.rows
    capture.seq_lens[:3] = live.seq_lens
    capture.seq_lens[3:] = 0
    capture.seq_lens_cpu = live.seq_lens_cpu + [0]
    backend.prepare_for_replay(capture)
    assert captured.rows is capture.rows and captured.seq_lens is capture.seq_lens
    # Longest first, the padding entry last.
    assert captured.order.tolist() == sorted(range(4), key=capture.seq_lens_cpu.__getitem__, reverse=True)
    q, k, v = random_qkv(4, heads, head_dim, gen)
    out = backend.forward(q, k, v, 0, capture)  # what replaying the captured kernels computes
    expected = reference(pool, 0, q[:3], live, 0.125)
    torch.testing.assert_close(out[:3], expected, atol=1e-4, rtol=1e-4)
    assert torch.all(out[3] == 0), "a padded entry (seq_len 0) must compute nothing"


def test_warmup_runs_every_split_count_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-start warm-up launches the decode kernels for each power-of-two split count (one
    request of one token in a given row) and leaves the pool untouched."""
    pool = KVPool(NUM_LAYERS, 8, PAGE_SIZE, 1, 64, torch.float32, DEVICE)
    for cache in (*pool.k, *pool.v):
        cache.copy_(torch.randn(cache.shape))
    before = [t.clone() for t in (*pool.k, *pool.v)]
    backend = create_triton_backend(pool, 2, 1, 64, 0.125)
    table = torch.zeros(3, 16, dtype=torch.int32, device=DEVICE)
    table[2, 0] = 5
    calls: list[int] = []
    original = triton_backend_module.decode_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(int(kwargs["num_splits"]))  # type: ignore[call-overload]
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend_module, "decode_attention", counting)
    backend.warmup(table, 2)
    assert calls == [1, 2, 4, 8, 16, 32, 64]
    assert all(torch.equal(a, b) for a, b in zip((*pool.k, *pool.v), before))
