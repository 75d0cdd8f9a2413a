"""Split decode attention merged by the last split program of each (request, KV head)
(`decode_attention(..., merge=True)`, the default) against the separate reduce kernel and the
torch reference: same result (up to fp32 summation order), zeros for padding entries, and the
arrival counters back at zero after every launch, also from a CUDA graph on the GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels.arrival import arrival_counters  # noqa: E402
from minisgl.kernels.attention import alloc_decode_buffers, decode_attention  # noqa: E402
from minisgl.kernels.attention_ref import decode_attention_ref  # noqa: E402
from tests.kernels.test_attention_kernels import DEVICE, assert_close, build_case  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _counters_zero() -> bool:
    return int(arrival_counters(DEVICE).abs().sum()) == 0


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_merged_splits_match_reduce_kernel(num_splits: int) -> None:
    case = build_case([4, 299, 63, 16, 120], [1] * 5, 8, 2, 64, 16, torch.float32, seed=num_splits)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.125)
    order = torch.tensor([1, 4, 2, 3, 0], dtype=torch.int32, device=DEVICE)
    merged = decode_attention(*args, num_splits=num_splits, block_n=16, order=order, merge=True)
    reduced = decode_attention(*args, num_splits=num_splits, block_n=16, order=order, merge=False)
    torch.testing.assert_close(merged, reduced, atol=1e-6, rtol=1e-6)
    assert_close(merged, decode_attention_ref(*args), torch.float32)
    assert _counters_zero()
    # Deterministic: the merge sums the splits in split order, whoever arrives last.
    assert torch.equal(merged, decode_attention(*args, num_splits=num_splits, block_n=16, order=order, merge=True))


def test_merged_padding_entry_is_zero() -> None:
    case = build_case([40, 7], [1, 1], 4, 1, 64, 16, torch.float32, seed=2)
    case.seq_lens[1] = 0
    mid_o, mid_lse = alloc_decode_buffers(6, 4, 64, 8, DEVICE)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))  # stale scratch must not leak into the result
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.125)
    out = decode_attention(*args, num_splits=4, block_n=16, mid_o=mid_o, mid_lse=mid_lse, merge=True)
    assert_close(out[:1], decode_attention_ref(*args)[:1], torch.float32)
    assert torch.all(out[1] == 0)
    assert _counters_zero()


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [2, 8, 64])
def test_merged_splits_gpu_and_graph(num_splits: int) -> None:
    lens = [100, 2048, 900, 1, 513, 1500, 77, 1024]
    case = build_case([n - 1 for n in lens], [1] * len(lens), 16, 8, 128, 16, torch.bfloat16, seed=num_splits)
    args = (case.q, case.k_cache, case.v_cache, case.token_table, case.rows, case.seq_lens, 0.088)
    reduced = decode_attention(*args, num_splits=num_splits, merge=False)
    merged = decode_attention(*args, num_splits=num_splits, merge=True)
    # fp32 sums in another order, then one bf16 rounding: at most an ulp apart.
    torch.testing.assert_close(merged.float(), reduced.float(), atol=1e-2, rtol=1e-2)
    assert (merged != reduced).float().mean().item() < 0.02
    assert_close(merged, decode_attention_ref(*args), torch.bfloat16)
    out = torch.empty_like(merged)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, num_splits=num_splits, merge=True, out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, merged)
    assert _counters_zero()
