"""The Triton extend and decode kernels with a sliding window and a logit soft-cap against the
torch references and the torch attention backend.

Under TRITON_INTERPRET=1 without CUDA (tiny shapes, 16-wide blocks); the `gpu` tests run the
default launches in half precision. Besides the NaN-poisoned spare pages of `build_case`, every
K/V position older than the oldest key any query of its request may see is NaN too: a kernel that
reads a block wholly outside the window (instead of skipping it) outputs NaN.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.attention.base import AttnLayerSpec  # noqa: E402
from minisgl.attention.batch import ForwardBatch  # noqa: E402
from minisgl.attention.torch_backend import TorchAttnBackend  # noqa: E402
from minisgl.kernels.attention import (  # noqa: E402
    MAX_DECODE_SPLITS,
    alloc_decode_buffers,
    decode_attention,
    extend_attention,
    is_interpreted,
)
from minisgl.kernels.attention_ref import decode_attention_ref, extend_attention_ref  # noqa: E402
from minisgl.kvcache.pool import KVPool  # noqa: E402
from tests.kernels.test_attention_kernels import DEVICE, PagedCase, assert_close, build_case  # noqa: E402

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def poison_outside_window(case: PagedCase, window: int | None) -> None:
    """NaN at every position of a request older than what its first new token can see."""
    if window is None:
        return
    for row, seq_len, ext in zip(case.rows.tolist(), case.seq_lens.tolist(), case.extend_lens.tolist()):
        oldest = seq_len - ext - window + 1
        if oldest > 0:
            slots = case.token_table[row, :oldest].long()
            case.k_cache[slots] = float("nan")
            case.v_cache[slots] = float("nan")


def run_both_extend(
    case: PagedCase, sm_scale: float, window: int | None, softcap: float | None, **launch: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the intact cache, then the kernel on the cache poisoned outside the window
    (the reference multiplies every gathered value, so it would turn NaN itself)."""
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
            case.extend_lens, case.extend_starts, sm_scale)  # fmt: skip
    ref = extend_attention_ref(*args, window=window, softcap=softcap)
    poison_outside_window(case, window)
    out = extend_attention(*args, max_extend_len=int(case.extend_lens.max()), window=window, softcap=softcap,
                           **launch)  # type: ignore[arg-type]  # fmt: skip
    return out, ref


WINDOWS = [None, 5, 20]  # off, narrower than a 16-row query block, wider than one
SOFTCAPS = [None, 50.0, 2.0]  # Gemma 2's attention cap, and one that bends N(0, 1) scores

# (prefix_lens, extend_lens): fresh prompts longer than the window, extends whose cached prefix
# crosses the window (several whole blocks before it), one-token extends, one within the window.
EXTEND = ([0, 40, 3, 57, 9], [33, 20, 1, 2, 4])


# Every (window, soft-cap) pair, each with one of the page sizes the engine uses.
EXTEND_CASES = [(w, c, (1, 4, 16)[i % 3]) for i, (w, c) in enumerate(itertools.product(WINDOWS, SOFTCAPS))]


@pytest.mark.parametrize("window,softcap,page_size", EXTEND_CASES)
def test_extend_window_softcap_matches_ref(window: int | None, softcap: float | None, page_size: int) -> None:
    case = build_case(*EXTEND, 4, 2, 16, page_size, torch.float32, seed=page_size, q_padding_heads=1)
    out, ref = run_both_extend(case, 0.4, window, softcap, block_m=16, block_n=16)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("window,softcap", [(5, None), (20, 2.0)])
def test_extend_window_packed_heads(window: int, softcap: float | None) -> None:
    """A KV head's q heads packed in one tile (each row its own query position) under a window."""
    case = build_case(*EXTEND, 4, 2, 16, 4, torch.float32, seed=3)
    out, ref = run_both_extend(case, 0.4, window, softcap, block_m=32, block_n=16, pack=True)
    assert_close(out, ref, torch.float32)


# (seq_lens, num_splits): sequences far past the window (its keys split several ways), one within it.
DECODE = [([70, 3, 41, 16], 1), ([70, 3, 41, 16], 4), ([129, 1, 200], 3)]


DECODE_CASES = [(w, c, *DECODE[i % 3]) for i, (w, c) in enumerate(itertools.product(WINDOWS, SOFTCAPS))]


@pytest.mark.parametrize("window,softcap,seq_lens,num_splits", DECODE_CASES)
def test_decode_window_softcap_matches_ref(
    window: int | None, softcap: float | None, seq_lens: list[int], num_splits: int
) -> None:
    case = build_case([s - 1 for s in seq_lens], [1] * len(seq_lens), 6, 2, 16, 4, torch.float32, seed=num_splits)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.4)
    ref = decode_attention_ref(*args, window=window, softcap=softcap)
    poison_outside_window(case, window)
    out = decode_attention(*args, num_splits=num_splits, block_n=16, window=window, softcap=softcap)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [4, 1])
def test_decode_window_graph_buffers_and_empty_entries(num_splits: int) -> None:
    """Graph-style launch under a window: oversized scratch with stale NaN, a padded entry of
    seq_len 0 (zeros out), a long entry whose splits divide only its window."""
    case = build_case([90, 7, 0], [1, 1, 1], 4, 2, 16, 4, torch.float32, seed=9)
    case.seq_lens[2] = 0
    mid_o, mid_lse = alloc_decode_buffers(6, 4, 16, MAX_DECODE_SPLITS, DEVICE)
    mid_lse.fill_(float("nan"))
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.4)
    ref = decode_attention_ref(*args, window=12, softcap=3.0)
    poison_outside_window(case, 12)
    out = decode_attention(*args, num_splits=num_splits, block_n=16, mid_o=mid_o, mid_lse=mid_lse, window=12,
                           softcap=3.0)  # fmt: skip
    assert_close(out, ref, torch.float32)
    assert torch.all(out[2] == 0)


def test_window_refs_match_dense_formula() -> None:
    """The references themselves: windowed, capped attention written out per query and head."""
    case = build_case([0, 12], [9, 3], 2, 1, 16, 4, torch.float32, seed=7)
    window, cap, scale = 4, 1.5, 0.3
    ref = extend_attention_ref(case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
                               case.extend_lens, case.extend_starts, scale, window=window, softcap=cap)  # fmt: skip
    start = 0
    for k, v, ext in zip(case.k_dense, case.v_dense, case.extend_lens.tolist()):
        for j in range(ext):
            pos = k.shape[0] - ext + j
            lo = max(0, pos - window + 1)
            for head in range(2):
                scores = torch.tanh(k[lo : pos + 1, 0].double() @ case.q[start + j, head].double() * scale / cap) * cap
                expected = torch.softmax(scores, 0) @ v[lo : pos + 1, 0].double()
                torch.testing.assert_close(ref[start + j, head].double(), expected, atol=1e-5, rtol=1e-5)
        start += ext


# ---- the backends: same pool, same batch, every layer kind of a Gemma-like model ----

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 16, 4
LAYER_SPECS = [AttnLayerSpec(), AttnLayerSpec(sliding_window=6), AttnLayerSpec(logit_cap=2.0),
               AttnLayerSpec(sliding_window=5, logit_cap=50.0)]  # fmt: skip


def _batch(seq_lens: list[int], extend_lens: list[int], gen: torch.Generator) -> tuple[KVPool, ForwardBatch]:
    num_layers = len(LAYER_SPECS)
    pool = KVPool(num_layers, 256, PAGE, KV_HEADS, HEAD_DIM, torch.float32, DEVICE)
    for layer in range(num_layers):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    pages = torch.randperm(256, generator=gen)
    table = torch.zeros(len(seq_lens), 128, dtype=torch.int32)
    pos = torch.arange(128)
    for row in range(len(seq_lens)):
        mine = pages[row * 32 : (row + 1) * 32]
        table[row] = (mine[pos // PAGE] * PAGE + pos % PAGE).int()
    out_loc = torch.cat([table[r, s - e : s] for r, (s, e) in enumerate(zip(seq_lens, extend_lens))]).long()
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    batch = ForwardBatch(
        phase="decode" if all(e == 1 for e in extend_lens) else "extend",
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=DEVICE),
        positions=torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)]).to(DEVICE),
        out_loc=out_loc.to(DEVICE), rows=torch.arange(len(seq_lens), device=DEVICE), seq_lens=i32(seq_lens),
        extend_lens=i32(extend_lens), extend_starts=i32(starts), token_table=table.to(DEVICE),
        seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens, sample_idx=torch.zeros(1, dtype=torch.int64, device=DEVICE),
    )  # fmt: skip
    return pool, batch


def backend_outputs(specs: list[AttnLayerSpec], seq_lens: list[int], extend_lens: list[int],
                    seed: int) -> dict[str, list[torch.Tensor]]:  # fmt: skip
    """The torch and the Triton backend's output for each layer spec, on one pool and batch
    (`_batch`) and the same random q, k and v: {"torch": [...], "triton": [...]}."""
    from minisgl.attention.triton_backend import create_triton_backend

    gen = torch.Generator().manual_seed(seed)
    pool, batch = _batch(seq_lens, extend_lens, gen)
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    kv = [torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE) for _ in range(2)]
    backends = {"torch": TorchAttnBackend(pool, HEADS, KV_HEADS, HEAD_DIM, 0.3),
                "triton": create_triton_backend(pool, HEADS, KV_HEADS, HEAD_DIM, 0.3)}  # fmt: skip
    outs: dict[str, list[torch.Tensor]] = {}
    for name, backend in backends.items():
        for layer, spec in enumerate(specs):
            backend.configure_layer(layer, spec)
        backend.prepare(batch)
        outs[name] = [backend.forward(q, kv[0], kv[1], layer, batch).clone() for layer in range(len(specs))]
        batch.attn_meta = None
    return outs


@pytest.mark.parametrize(
    "seq_lens,extend_lens",
    [([11, 32, 4, 17, 40], [11, 12, 4, 1, 1]), ([3, 9, 30, 77], [1, 1, 1, 1])],
    ids=["mixed-extend", "decode"],
)
def test_triton_backend_matches_torch_backend(seq_lens: list[int], extend_lens: list[int]) -> None:
    """Per layer spec, TritonAttnBackend (its mixed extend + decode split included) equals the
    torch backend on the same pool and batch."""
    outs = backend_outputs(LAYER_SPECS, seq_lens, extend_lens, seed=5)
    for layer, spec in enumerate(LAYER_SPECS):
        assert_close(outs["triton"][layer], outs["torch"][layer], torch.float32)
    # The windows and the cap changed the result (the comparison above is not of plain attention).
    assert not torch.allclose(outs["torch"][0], outs["torch"][1]) and not torch.allclose(outs["torch"][0], outs["torch"][2])


def test_triton_backend_warmup_runs_every_layer_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up warm-up launches each distinct layer spec's kernels (each decode split count,
    here up to 2 to keep the interpreter quick; both extend launches) without error."""
    import minisgl.attention.triton_backend as triton_backend
    from minisgl.attention.triton_backend import create_triton_backend

    monkeypatch.setattr(triton_backend, "MAX_DECODE_SPLITS", 2)

    pool = KVPool(len(LAYER_SPECS), 8, PAGE, KV_HEADS, HEAD_DIM, torch.float32, DEVICE)
    backend = create_triton_backend(pool, HEADS, KV_HEADS, HEAD_DIM, 0.3)
    for layer, spec in enumerate(LAYER_SPECS):
        backend.configure_layer(layer, spec)
    token_table = torch.zeros(2, 8 * PAGE, dtype=torch.int32, device=DEVICE)
    backend.warmup(token_table, 1)


def test_triton_backend_decode_splits_follow_the_window() -> None:
    """Every layer windowed: eager decode sizes its splits by the window, not the sequence."""
    from minisgl.attention.triton_backend import create_triton_backend

    pool = KVPool(2, 64, PAGE, KV_HEADS, HEAD_DIM, torch.float32, DEVICE)
    backend = create_triton_backend(pool, HEADS, KV_HEADS, HEAD_DIM, 0.3)
    backend.configure_layer(0, AttnLayerSpec(sliding_window=8))
    assert backend.decode_window is None  # layer 1 is still global
    backend.configure_layer(1, AttnLayerSpec(sliding_window=16, logit_cap=3.0))
    assert backend.decode_window == 16
    backend.configure_layer(1, AttnLayerSpec())
    assert backend.decode_window is None


# ---- GPU: default launches, half precision, long contexts ----


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, 50.0), (512, None), (4096, None), (700, 50.0)])
@pytest.mark.parametrize("heads,head_dim", [((8, 4), 256), ((16, 8), 128), ((24, 8), 128)])
def test_gpu_window_softcap(
    dtype: torch.dtype, window: int | None, softcap: float | None, heads: tuple[int, int], head_dim: int
) -> None:
    """Gemma-2/3-like (D 256), Qwen3-0.6B-like (the packed extend launch) and Phi-4-mini-like heads."""
    prefix_lens, extend_lens = [0, 5000, 37, 3000, 0], [300, 129, 1, 1200, 64]
    for max_seq_len in (None, 1000):
        case = build_case(prefix_lens, extend_lens, *heads, head_dim, 16, dtype, seed=11)
        out, ref = run_both_extend(case, head_dim**-0.5, window, softcap, max_seq_len=max_seq_len)
        assert_close(out, ref, dtype)
    seq_lens = [1, 8000, 130, 4097, 64]
    dc = build_case([s - 1 for s in seq_lens], [1] * 5, *heads, head_dim, 16, dtype, seed=12)
    args = (dc.q, dc.k_cache, dc.v_cache, dc.token_table, dc.rows, dc.seq_lens, head_dim**-0.5)
    ref = decode_attention_ref(*args, window=window, softcap=softcap)
    poison_outside_window(dc, window)
    for num_splits in (1, 8, 64):
        out = decode_attention(*args, num_splits=num_splits, window=window, softcap=softcap)
        assert_close(out, ref, dtype)
