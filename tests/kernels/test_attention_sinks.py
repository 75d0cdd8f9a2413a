"""Attention sinks (GPT-OSS: a learned logit per q head in every softmax denominator) in the Triton
extend and decode kernels against the torch references, the references against the formula
written out, and the Triton backend against the torch backend on sink layers.

Under TRITON_INTERPRET=1 without CUDA (tiny shapes, 16-wide blocks); the `gpu` tests run the
default launches in bf16. Sinks are drawn large enough (N(0, 2)) to take a real share of the
softmax: a kernel that dropped them, or counted one per split, would be far off.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.attention.base import AttnLayerSpec  # noqa: E402
from minisgl.kernels.attention import alloc_decode_buffers, decode_attention, extend_attention  # noqa: E402
from minisgl.kernels.attention import MAX_DECODE_SPLITS, is_interpreted  # noqa: E402
from minisgl.kernels.attention_ref import decode_attention_ref, extend_attention_ref  # noqa: E402
from tests.kernels.test_attention_kernels import DEVICE, assert_close, build_case  # noqa: E402
from tests.kernels.test_attention_windows import HEADS, backend_outputs, poison_outside_window  # noqa: E402

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXTEND = ([0, 40, 3, 57, 9], [33, 20, 1, 2, 4])


def _sinks(num_heads: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 2.0).to(dtype).to(DEVICE)


@pytest.mark.parametrize("window,softcap,pack", [(None, None, False), (5, None, False), (20, 2.0, False),
                                                 (None, None, True), (5, None, True)])  # fmt: skip
def test_extend_sinks_match_ref(window: int | None, softcap: float | None, pack: bool) -> None:
    case = build_case(*EXTEND, 4, 2, 16, 4, torch.float32, seed=2, q_padding_heads=0 if pack else 1)
    sinks = _sinks(4, 1)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
            case.extend_lens, case.extend_starts, 0.4)  # fmt: skip
    ref = extend_attention_ref(*args, window=window, softcap=softcap, sinks=sinks)
    plain = extend_attention_ref(*args, window=window, softcap=softcap)
    assert (ref - plain).abs().max() > 1e-2, "the sinks should change the output"
    poison_outside_window(case, window)
    block_m = 32 if pack else 16
    out = extend_attention(*args, max_extend_len=int(case.extend_lens.max()), window=window, softcap=softcap,
                           sinks=sinks, block_m=block_m, block_n=16, pack=pack)  # fmt: skip
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_decode_sinks_match_ref(window: int | None, num_splits: int) -> None:
    """One split (the sink joins in stage 1) and several (it joins in the merge, once)."""
    seq_lens = [70, 3, 41, 16]
    case = build_case([s - 1 for s in seq_lens], [1] * 4, 6, 2, 16, 4, torch.float32, seed=num_splits)
    sinks = _sinks(6, num_splits)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.4)
    ref = decode_attention_ref(*args, window=window, sinks=sinks)
    poison_outside_window(case, window)
    out = decode_attention(*args, num_splits=num_splits, block_n=16, window=window, sinks=sinks)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [4, 1])
def test_decode_sinks_graph_buffers_and_empty_entries(num_splits: int) -> None:
    """Oversized scratch with stale NaN and a padded entry of seq_len 0, which stays zero."""
    case = build_case([90, 7, 0], [1, 1, 1], 4, 2, 16, 4, torch.float32, seed=9)
    case.seq_lens[2] = 0
    mid_o, mid_lse = alloc_decode_buffers(6, 4, 16, MAX_DECODE_SPLITS, DEVICE)
    mid_lse.fill_(float("nan"))
    sinks = _sinks(4, 3)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.4)
    ref = decode_attention_ref(*args, sinks=sinks)
    out = decode_attention(*args, num_splits=num_splits, block_n=16, mid_o=mid_o, mid_lse=mid_lse, sinks=sinks)
    assert_close(out, ref, torch.float32)
    assert torch.all(out[2] == 0)


def test_sink_refs_match_the_formula() -> None:
    """softmax over [scores, sink] with the sink's column dropped, per query and head, in fp64."""
    case = build_case([0, 12], [9, 3], 2, 1, 16, 4, torch.float32, seed=7)
    sinks, scale, window = _sinks(2, 5), 0.3, 4
    ref = extend_attention_ref(case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
                               case.extend_lens, case.extend_starts, scale, window=window, sinks=sinks)  # fmt: skip
    start = 0
    for k, v, ext in zip(case.k_dense, case.v_dense, case.extend_lens.tolist()):
        for j in range(ext):
            pos = k.shape[0] - ext + j
            lo = max(0, pos - window + 1)
            for head in range(2):
                scores = k[lo : pos + 1, 0].double() @ case.q[start + j, head].double() * scale
                weights = torch.exp(scores) / (torch.exp(scores).sum() + torch.exp(sinks[head].double()))
                expected = weights @ v[lo : pos + 1, 0].double()
                torch.testing.assert_close(ref[start + j, head].double(), expected, atol=1e-5, rtol=1e-5)
        start += ext


@pytest.mark.parametrize(
    "seq_lens,extend_lens",
    [([11, 32, 4, 17, 40], [11, 12, 4, 1, 1]), ([3, 9, 30, 77], [1, 1, 1, 1])],
    ids=["mixed-extend", "decode"],
)
def test_triton_backend_matches_torch_backend_with_sinks(seq_lens: list[int], extend_lens: list[int]) -> None:
    """GPT-OSS's two layer kinds (windowed and full, both with sinks) and a plain layer: the Triton
    backend (mixed extend + decode split included) equals the torch backend."""
    specs = [AttnLayerSpec(sliding_window=6, sinks=_sinks(HEADS, 1)), AttnLayerSpec(sinks=_sinks(HEADS, 2)),
             AttnLayerSpec(), AttnLayerSpec(sliding_window=5, logit_cap=50.0, sinks=_sinks(HEADS, 3))]  # fmt: skip
    outs = backend_outputs(specs, seq_lens, extend_lens, seed=8)
    for layer in range(len(specs)):
        assert_close(outs["triton"][layer], outs["torch"][layer], torch.float32)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_default_launches_bf16_gpu(window: int | None) -> None:
    """GPT-OSS-20B's attention shape (64 q heads, 8 KV heads, D 64) in bf16, default launches."""
    case = build_case([0, 300, 1000], [200, 64, 1], 64, 8, 64, 16, torch.bfloat16, seed=4)
    sinks = _sinks(64, 6, torch.bfloat16)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens,
            case.extend_lens, case.extend_starts, 0.125)  # fmt: skip
    out = extend_attention(*args, max_extend_len=200, max_seq_len=1001, window=window, sinks=sinks)
    assert_close(out, extend_attention_ref(*args, window=window, sinks=sinks), torch.bfloat16)
    dcase = build_case([500, 3000, 17], [1, 1, 1], 64, 8, 64, 16, torch.bfloat16, seed=5)
    dargs = (dcase.q, dcase.k_cache, dcase.v_cache, dcase.token_table, dcase.rows, dcase.seq_lens, 0.125)
    for splits in (1, 8):
        out = decode_attention(*dargs, num_splits=splits, window=window, sinks=sinks)
        assert_close(out, decode_attention_ref(*dargs, window=window, sinks=sinks), torch.bfloat16)
