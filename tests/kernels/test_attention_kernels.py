"""Triton paged attention vs the torch references, and the references vs dense causal attention.

Without CUDA the kernels run in Triton's interpreter on small shapes (the unmarked tests, a few
seconds in all); the `gpu` tests sweep larger shapes, fp16/bf16 and the default block sizes.
KV pages are shuffled, unused slots and table entries past each sequence point at NaN, so a read
outside a request's positions shows up as NaN in the output.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
# Without CUDA, tests/conftest.py has put triton in interpreter mode before this import.

from minisgl.engine.graph import graph_batch_sizes  # noqa: E402
from minisgl.kernels.attention import (  # noqa: E402
    GRAPH_TUNED,
    MAX_DECODE_SPLITS,
    DecodeLaunch,
    alloc_decode_buffers,
    decode_attention,
    decode_graph_launch,
    decode_num_splits,
    extend_attention,
    is_interpreted,
)
from minisgl.kernels.attention_ref import decode_attention_ref, extend_attention_ref  # noqa: E402
from minisgl.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [slots, Hkv, D]
    v_cache: torch.Tensor
    token_table: torch.Tensor  # [R, C] int32
    rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    extend_starts: torch.Tensor  # [B] int32
    k_dense: list[torch.Tensor]  # per request [S, Hkv, D], positions in order
    v_dense: list[torch.Tensor]


def build_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    q_padding_heads: int = 0,
) -> PagedCase:
    """A paged cache holding every position < seq_len of each request, pages in random order.

    `q_padding_heads` > 0 makes q a strided view (as when q is split off a fused qkv tensor)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch_size = len(seq_lens)
    pages_needed = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 2  # the spare pages stay NaN: reading them poisons the output
    page_order = torch.randperm(num_pages, generator=gen)
    num_slots = num_pages * page_size
    poison_slot = int(page_order[-1]) * page_size
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    width = (max(pages_needed, default=0) + 1) * page_size
    token_table = torch.full((batch_size + 2, width), poison_slot, dtype=torch.int32)
    rows = torch.randperm(batch_size + 2, generator=gen)[:batch_size]
    k_dense: list[torch.Tensor] = []
    v_dense: list[torch.Tensor] = []
    next_page = 0
    for row, seq_len, pages in zip(rows.tolist(), seq_lens, pages_needed):
        page_ids = page_order[next_page : next_page + pages]
        next_page += pages
        pos = torch.arange(seq_len)
        slots = page_ids[pos // page_size] * page_size + pos % page_size
        token_table[row, :seq_len] = slots.int()
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        k_cache[slots] = k
        v_cache[slots] = v
        k_dense.append(k)
        v_dense.append(v)
    num_tokens = sum(extend_lens)
    q_full = torch.randn(num_tokens, num_heads + q_padding_heads, head_dim, generator=gen).to(dtype)
    starts = [sum(extend_lens[:i]) for i in range(batch_size)]

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    return PagedCase(
        q=dev(q_full)[:, :num_heads],
        k_cache=dev(k_cache),
        v_cache=dev(v_cache),
        token_table=dev(token_table),
        rows=dev(rows),
        seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
        extend_lens=dev(torch.tensor(extend_lens, dtype=torch.int32)),
        extend_starts=dev(torch.tensor(starts, dtype=torch.int32)),
        k_dense=k_dense,
        v_dense=v_dense,
    )


def dense_causal_attention(case: PagedCase, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """The textbook formula in fp64 on unpaged K/V, one head at a time: the oracle for the refs."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    q64 = q.cpu().double()
    group = q.shape[1] // case.k_dense[0].shape[1] if case.k_dense else 1
    start = 0
    for k, v, extend_len in zip(case.k_dense, case.v_dense, case.extend_lens.tolist()):
        seq_len = k.shape[0]
        for head in range(q.shape[1]):
            for j in range(extend_len):
                visible = seq_len - extend_len + j + 1
                scores = (k[:visible, head // group].double() @ q64[start + j, head]) * sm_scale
                out[start + j, head] = torch.softmax(scores, 0) @ v[:visible, head // group].double()
        start += extend_len
    return out


def run_extend(case: PagedCase, sm_scale: float, **blocks: Any) -> tuple[torch.Tensor, torch.Tensor]:
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
            case.extend_lens, case.extend_starts, sm_scale)  # fmt: skip
    max_extend_len = int(case.extend_lens.max())
    return extend_attention(*args, max_extend_len=max_extend_len, **blocks), extend_attention_ref(*args)


def run_decode(case: PagedCase, sm_scale: float, **launch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, sm_scale)
    return decode_attention(*args, **launch), decode_attention_ref(*args)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert not torch.isnan(actual).any(), "NaN: the kernel read a slot outside the request"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


# (prefix_lens, extend_lens): zero prefixes, prefixes off the 16-block grid, one-token extends,
# extends spanning several query blocks, a whole-block prefix.
EXTEND_SHAPES = {
    "single": ([0], [5]),
    "mixed3": ([0, 17, 33], [20, 1, 40]),
    "mixed5": ([3, 0, 50, 16, 9], [7, 33, 2, 16, 1]),
}
# (shape, (Hq, Hkv), head_dim, page_size): every GQA ratio, head dim and page size, in pairs.
EXTEND_CPU_CASES = [
    ("single", (2, 2), 64, 1),
    ("mixed3", (3, 1), 128, 16),
    ("mixed5", (8, 2), 64, 16),
    ("mixed3", (9, 3), 64, 1),  # the embedded model's per-rank heads: non-power-of-two counts
    ("mixed5", (3, 1), 128, 1),
    ("single", (8, 2), 128, 16),
]


@pytest.mark.parametrize("shape,heads,head_dim,page_size", EXTEND_CPU_CASES)
def test_extend_matches_ref(shape: str, heads: tuple[int, int], head_dim: int, page_size: int) -> None:
    prefix_lens, extend_lens = EXTEND_SHAPES[shape]
    case = build_case(prefix_lens, extend_lens, *heads, head_dim, page_size, torch.float32, q_padding_heads=1)
    # Small blocks so short sequences still cross query and key block boundaries.
    out, ref = run_extend(case, head_dim**-0.5, block_m=16, block_n=16)
    assert_close(out, ref, torch.float32)


PACKABLE_CASES = [case for case in EXTEND_CPU_CASES if case[1][0] // case[1][1] in (1, 2, 4)]


@pytest.mark.parametrize("shape,heads,head_dim,page_size", PACKABLE_CASES)
def test_extend_packed_heads_match_ref(shape: str, heads: tuple[int, int], head_dim: int, page_size: int) -> None:
    """A KV head's q heads packed into one tile's rows (`pack=True`): the same attention."""
    prefix_lens, extend_lens = EXTEND_SHAPES[shape]
    case = build_case(prefix_lens, extend_lens, *heads, head_dim, page_size, torch.float32, q_padding_heads=1)
    out, ref = run_extend(case, head_dim**-0.5, block_m=16 * (heads[0] // heads[1]), block_n=16, pack=True)
    assert_close(out, ref, torch.float32)


def test_extend_default_blocks_and_fp16() -> None:
    case = build_case([70, 0], [45, 9], 4, 2, 64, 16, torch.float16, seed=1)
    out, ref = run_extend(case, 0.125)
    assert out.dtype == torch.float16
    assert_close(out, ref, torch.float16)


# (seq_lens, num_splits): one token, contexts longer than a split, a split count beyond what a
# short request fills (trailing splits empty), and splits that do not divide the length.
DECODE_CPU_CASES = [
    ([1], 1, (2, 2), 64, 1),
    ([5, 300, 64, 17], 4, (3, 1), 128, 16),
    ([129, 1, 200], 3, (8, 2), 64, 1),
    ([90, 33], 16, (9, 3), 64, 16),
    ([5, 300, 64, 17], 1, (4, 2), 128, 16),  # one split: stage 1 writes the output itself
]


@pytest.mark.parametrize("seq_lens,num_splits,heads,head_dim,page_size", DECODE_CPU_CASES)
def test_decode_matches_ref(
    seq_lens: list[int], num_splits: int, heads: tuple[int, int], head_dim: int, page_size: int
) -> None:
    case = build_case([s - 1 for s in seq_lens], [1] * len(seq_lens), *heads, head_dim, page_size, torch.float32)
    out, ref = run_decode(case, head_dim**-0.5, num_splits=num_splits, block_n=16)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [3, 1])
def test_decode_start_order_changes_nothing(num_splits: int) -> None:
    """Programs taking the requests in another order (longest first, as the backend asks) give
    the same output bit for bit: each request's result is written at its own index."""
    case = build_case([4, 299, 63, 16, 120], [1] * 5, 4, 2, 64, 16, torch.float32, seed=5)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.125)
    plain = decode_attention(*args, num_splits=num_splits, block_n=16)
    order = torch.tensor([1, 4, 2, 3, 0], dtype=torch.int32, device=DEVICE)
    ordered = decode_attention(*args, num_splits=num_splits, block_n=16, order=order)
    assert torch.equal(plain, ordered)
    assert_close(ordered, decode_attention_ref(*args), torch.float32)


@pytest.mark.parametrize("num_splits", [5, 1])
def test_decode_static_buffers_and_empty_entries(num_splits: int) -> None:
    """Graph-style launch: oversized scratch buffers, and a padded entry with seq_len 0 gives zeros."""
    case = build_case([40, 7], [1, 1], 4, 1, 64, 16, torch.float32, seed=2)
    case.seq_lens[1] = 0
    mid_o, mid_lse = alloc_decode_buffers(6, 4, 64, MAX_DECODE_SPLITS, DEVICE)
    mid_lse.fill_(float("nan"))  # stale contents must not leak into the result
    out, ref = run_decode(case, 0.125, num_splits=num_splits, block_n=16, mid_o=mid_o, mid_lse=mid_lse)
    assert_close(out, ref, torch.float32)
    assert torch.all(out[1] == 0)


def test_refs_match_dense_attention() -> None:
    case = build_case([0, 17, 5], [6, 3, 1], 6, 2, 16, 4, torch.float32, seed=3)
    ref = extend_attention_ref(case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
                               case.extend_lens, case.extend_starts, 0.3)  # fmt: skip
    torch.testing.assert_close(ref.cpu().double(), dense_causal_attention(case, case.q, 0.3), atol=1e-5, rtol=1e-5)
    dc = build_case([9, 0, 30], [1, 1, 1], 4, 4, 16, 1, torch.float32, seed=4)
    ref = decode_attention_ref(dc.q, dc.k_cache, dc.v_cache, dc.token_table, dc.rows, dc.seq_lens, 0.25)
    expected = dense_causal_attention(dc, dc.q, 0.25)
    torch.testing.assert_close(ref.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_num_splits_is_bounded() -> None:
    assert decode_num_splits(1, 1, 128, 1, DEVICE) == 1  # one short request: no point splitting
    assert decode_num_splits(1, 1, 128, 10**6, DEVICE) <= MAX_DECODE_SPLITS
    assert decode_num_splits(512, 8, 128, 10**6, DEVICE) == 1  # the batch alone fills the device
    assert 1 <= decode_num_splits(2, 3, 64, None, DEVICE) <= MAX_DECODE_SPLITS
    # Splits fall as the batch grows, which bounds the graph scratch by bs * splits(bs).
    splits = [decode_num_splits(bs, 2, 128, None, DEVICE) for bs in range(1, 65)]
    assert splits == sorted(splits, reverse=True)
    # Powers of two only (a compile-time constant: few kernel variants), eager lengths included.
    counts = {decode_num_splits(bs, 8, 128, n, DEVICE) for bs in range(1, 40) for n in range(1, 9000, 97)}
    assert counts <= {1, 2, 4, 8, 16, 32, 64} and len(counts) > 1


# ---- GPU sweep: real block sizes, long contexts, half precision ----

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (32, 8), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_gpu_sweep(dtype: torch.dtype, heads: tuple[int, int], head_dim: int, page_size: int) -> None:
    prefix_lens = [0, 1000, 37, 511, 0]
    extend_lens = [300, 129, 1, 700, 64]
    case = build_case(prefix_lens, extend_lens, *heads, head_dim, page_size, dtype, seed=5, q_padding_heads=2)
    out, ref = run_extend(case, head_dim**-0.5)
    assert_close(out, ref, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_gpu_packed_launches(dtype: torch.dtype, page_size: int) -> None:
    """Qwen3-0.6B's heads (16 q, 8 KV, D 128): both tuned launches pack a KV head's two q heads in
    one tile, the short-sequence one (every sequence <= 2048) and the long one."""
    case = build_case([0, 1000, 37, 511, 0], [300, 129, 1, 700, 64], 16, 8, 128, page_size, dtype, seed=9)
    for max_seq_len in (1129, None):
        out, ref = run_extend(case, 128**-0.5, max_seq_len=max_seq_len)
        assert_close(out, ref, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (32, 8), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_gpu_sweep(dtype: torch.dtype, heads: tuple[int, int], head_dim: int, page_size: int) -> None:
    seq_lens = [1, 4097, 130, 2000, 64]
    case = build_case([s - 1 for s in seq_lens], [1] * len(seq_lens), *heads, head_dim, page_size, dtype, seed=6)
    auto = decode_num_splits(len(seq_lens), heads[1], head_dim, max(seq_lens), DEVICE)
    for num_splits in (1, auto, MAX_DECODE_SPLITS):
        out, ref = run_decode(case, head_dim**-0.5, num_splits=num_splits)
        assert_close(out, ref, dtype)


def test_graph_tuned_launches_are_valid() -> None:
    """Every measured launch is one the kernel and the graph scratch take: a power-of-two split
    count within MAX_DECODE_SPLITS (eager decode compiles only those), a tile the sweep ran."""
    assert GRAPH_TUNED, "kernels/tuned/decode_attention.json lists no launch"
    for (device_name, num_kv_heads, num_heads, head_dim), table in GRAPH_TUNED.items():
        assert device_name.startswith("NVIDIA ") and num_heads % num_kv_heads == 0 and head_dim in (64, 128, 256)
        for batch_size, launch in table.items():
            assert batch_size in graph_batch_sizes(256)
            assert launch.num_splits in {1, 2, 4, 8, 16, 32, 64}
            assert launch.block_n in (16, 32, 64) and launch.num_warps in (2, 4, 8) and launch.num_stages in (2, 3, 4)
    # Off CUDA (and with --no-decode-tuned) the heuristic's count and the default launch.
    heuristic = DecodeLaunch(decode_num_splits(1, 8, 128, None, DEVICE))
    assert decode_graph_launch(1, 16, 8, 128, torch.bfloat16, DEVICE) == heuristic


def test_graph_tuned_launch_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which captured sizes take a table launch, on a (pretend) 132-SM H200: the listed sizes of
    the measured shape with a 16-bit cache; everything else (another GPU too) the heuristic."""
    import minisgl.kernels.attention.decode as decode
    import minisgl.kernels.attention.tuned as tuned

    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(tuned, "device_name", lambda device: "NVIDIA H200")
    cuda = torch.device("cuda", 0)  # only its type, the patched SM count and name are read

    def heuristic(bs: int, num_kv_heads: int = 8) -> DecodeLaunch:
        return DecodeLaunch(decode_num_splits(bs, num_kv_heads, 128, None, cuda))

    table = GRAPH_TUNED[("NVIDIA H200", 8, 16, 128)]
    assert decode_graph_launch(176, 16, 8, 128, torch.bfloat16, cuda) == table[176]
    assert decode_graph_launch(1, 16, 8, 128, torch.float16, cuda) == table[1]
    assert decode_graph_launch(160, 16, 8, 128, torch.bfloat16, cuda) == heuristic(160)  # not listed
    assert decode_graph_launch(176, 32, 8, 128, torch.bfloat16, cuda) == heuristic(176)  # other heads
    # An fp32 cache moves twice the bytes per tile: the 16-bit measurements do not apply to it.
    assert decode_graph_launch(176, 16, 8, 128, torch.float32, cuda) == heuristic(176)
    assert decode_graph_launch(176, 16, 8, 128, torch.bfloat16, cuda, tuned=False) == heuristic(176)
    monkeypatch.setattr(tuned, "device_name", lambda device: "NVIDIA H100 80GB HBM3")  # 132 SMs too
    assert decode_graph_launch(176, 16, 8, 128, torch.bfloat16, cuda) == heuristic(176)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_gpu_graph_tuned_launches(dtype: torch.dtype) -> None:
    """Each launch of GRAPH_TUNED, on its shape, against the reference: long, short and empty
    (padding) requests, as a captured batch holds them."""
    for (_, num_kv_heads, num_heads, head_dim), table in GRAPH_TUNED.items():
        for batch_size, launch in table.items():
            seq_lens = [(1 + 977 * i) % 2100 + 1 for i in range(batch_size)]
            case = build_case([n - 1 for n in seq_lens], [1] * batch_size, num_heads, num_kv_heads, head_dim, 16,
                              dtype, seed=batch_size)  # fmt: skip
            if batch_size > 1:
                case.seq_lens[-1] = 0  # a padding row: attends to nothing, outputs zeros
            out, ref = run_decode(case, head_dim**-0.5, **launch._asdict())
            assert_close(out, ref, dtype)


@gpu
@needs_cuda
def test_decode_cuda_graph_replay() -> None:
    """Captured once, replayed with other lengths: the split count is a launch constant."""
    case = build_case([2999, 15], [1, 1], 8, 2, 128, 16, torch.bfloat16, seed=7)
    mid_o, mid_lse = alloc_decode_buffers(2, 8, 128, MAX_DECODE_SPLITS, DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 128**-0.5)
    launch: dict[str, Any] = dict(num_splits=MAX_DECODE_SPLITS, mid_o=mid_o, mid_lse=mid_lse)
    out = decode_attention(*args, **launch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*args, **launch)
    case.seq_lens.copy_(torch.tensor([16, 3000], dtype=torch.int32))
    case.rows.copy_(case.rows.flip(0))
    graph.replay()
    assert_close(out, decode_attention_ref(*args), torch.bfloat16)


@gpu
@needs_cuda
def test_backend_cuda_graph_capture_and_replay() -> None:
    """TritonAttnBackend captured at bs 8, replayed for a live bs-5 batch of other lengths."""
    from minisgl.attention.batch import ForwardBatch
    from minisgl.attention.triton_backend import create_triton_backend
    from minisgl.kvcache.pool import KVPool

    gen = torch.Generator(device=DEVICE).manual_seed(8)
    heads, head_dim, page_size, max_bs, width = (8, 2), 128, 16, 8, 1024
    pool = KVPool(1, max_bs * width // page_size, page_size, heads[1], head_dim, torch.bfloat16, DEVICE)
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    backend = create_triton_backend(pool, *heads, head_dim, head_dim**-0.5)
    backend.init_graph_state(max_bs)
    page_order = torch.randperm(pool.num_pages, generator=gen, device=DEVICE).view(max_bs, -1)
    pos = torch.arange(width, device=DEVICE)
    token_table = (page_order[:, pos // page_size] * page_size + pos % page_size).int()

    def decode_batch(rows: list[int], seq_lens: list[int], out_loc: torch.Tensor) -> ForwardBatch:
        bs = len(rows)
        rows_t = torch.tensor(rows, device=DEVICE)
        return ForwardBatch(
            phase="decode", input_ids=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
            positions=torch.tensor(seq_lens, device=DEVICE) - 1, out_loc=out_loc, rows=rows_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            extend_lens=torch.ones(bs, dtype=torch.int32, device=DEVICE),
            extend_starts=torch.arange(bs, dtype=torch.int32, device=DEVICE), token_table=token_table,
            seq_lens_cpu=seq_lens, extend_lens_cpu=[1] * bs, sample_idx=torch.arange(bs, device=DEVICE),
        )  # fmt: skip

    static_q = torch.zeros(max_bs, heads[0], head_dim, dtype=torch.bfloat16, device=DEVICE)
    static_kv = torch.zeros(2, max_bs, heads[1], head_dim, dtype=torch.bfloat16, device=DEVICE)
    static_loc = torch.full((max_bs,), pool.scratch_slot, dtype=torch.int64, device=DEVICE)
    capture = decode_batch(list(range(max_bs)), [1] * max_bs, static_loc)
    backend.prepare_for_capture(capture)
    backend.forward(static_q, static_kv[0], static_kv[1], 0, capture)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static_q, static_kv[0], static_kv[1], 0, capture)

    rows, seq_lens = [3, 1, 4, 0, 6], [1000, 1, 77, 513, 129]
    live_loc = token_table[torch.tensor(rows, device=DEVICE), torch.tensor(seq_lens, device=DEVICE) - 1].long()
    live = decode_batch(rows, seq_lens, live_loc)
    static_q[:5].normal_(generator=gen)
    static_kv[:, :5].normal_(generator=gen)
    static_loc[:5] = live_loc
    # What the graph runner does before a replay: the live batch into the captured buffers, the
    # padding entries at seq_len 0, then the backend's order for these lengths.
    capture.rows[:5] = live.rows
    capture.seq_lens[:5] = live.seq_lens
    capture.seq_lens[5:] = 0
    capture.seq_lens_cpu = seq_lens + [0] * (max_bs - 5)
    backend.prepare_for_replay(capture)
    graph.replay()
    expected = decode_attention_ref(static_q[:5], pool.k[0], pool.v[0], token_table, live.rows, live.seq_lens,
                                    head_dim**-0.5)  # fmt: skip
    assert torch.equal(pool.k[0][live_loc], static_kv[0, :5]), "the replay stored the new keys"
    assert_close(out[:5], expected, torch.bfloat16)
    assert torch.all(out[5:] == 0)


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (2, 128)])
def test_store_kv_matches_ref(num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(9)
    # k and v as strided views of one fused projection output, as attention layers produce them.
    kv = torch.randn(7, 2, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    out_loc = torch.randperm(40, generator=gen)[:7].to(DEVICE)
    caches = [torch.zeros(40, num_kv_heads, head_dim, device=DEVICE) for _ in range(4)]
    store_kv(kv[:, 0], kv[:, 1], caches[0], caches[1], out_loc)
    store_kv_ref(kv[:, 0], kv[:, 1], caches[2], caches[3], out_loc)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_extend_block_order_changes_nothing() -> None:
    """Query blocks launched last first (the default) or in position order: the same output, bit
    for bit (each block writes its own rows)."""
    case = build_case([3, 0, 50], [7, 70, 2], 4, 2, 64, 16, torch.float32, seed=8)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
            case.extend_lens, case.extend_starts, 0.125)  # fmt: skip
    first = extend_attention(*args, max_extend_len=70, block_m=16, block_n=16)
    second = extend_attention(*args, max_extend_len=70, block_m=16, block_n=16, last_blocks_first=False)
    assert torch.equal(first, second)
    assert_close(first, extend_attention_ref(*args), torch.float32)
