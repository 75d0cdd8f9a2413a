"""Decode attention with the rotary kernel's work folded in (`decode_attention(..., rope=...)`)
against the two launches it replaces (`rotary_store_kv`, then `decode_attention` on the rotated
q): the same output and the same cache contents, bit for bit, for every split count, with and
without Qwen3's q/k norms and the folded input norm. Interpreter on CPU (fp32, fp16); the `gpu`
tests repeat it compiled in bf16."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels.attention import DecodeRope, decode_attention  # noqa: E402
from minisgl.kernels.rotary import rotary_store_kv  # noqa: E402
from tests.kernels.test_attention_kernels import DEVICE, build_case  # noqa: E402

CUDA = torch.cuda.is_available()

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _tables(head_dim: int, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    half = head_dim // 2
    inv = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return freqs.cos().to(device).contiguous(), freqs.sin().to(device).contiguous()


def _check(heads: tuple[int, int], head_dim: int, dtype: torch.dtype, splits: int, qk_norm: bool, folded: bool,
           padded: bool = False) -> None:  # fmt: skip
    num_heads, num_kv_heads = heads
    prefix = [0, 17, 40, 5]
    case = build_case(prefix, [1] * len(prefix), num_heads, num_kv_heads, head_dim, 16, dtype, seed=splits)
    gen = torch.Generator().manual_seed(7)
    batch = len(prefix)
    seq_lens = case.seq_lens.clone()
    if padded:  # a CUDA-graph padding entry: seq_len 0, its k/v go to a scratch slot
        seq_lens[-1] = 0
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(batch, width, generator=gen) * 2).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(batch, -1, head_dim) for t in (q, k, v))
    positions = (case.seq_lens.long() - 1).clamp_min(0).to(DEVICE)
    table = case.token_table
    out_loc = table[case.rows.long(), positions].long()
    if padded:
        out_loc[-1] = int(table.max()) + 1 if int(table.max()) + 1 < case.k_cache.shape[0] else out_loc[-1]
    cos, sin = _tables(head_dim, 64, DEVICE)
    norm = None
    if qk_norm:
        w = (torch.rand(2, head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE)
        norm = (w[0].contiguous(), w[1].contiguous(), 1e-6, 1e-6)
    row_norm = ((torch.randn(batch, 96, generator=gen) * 3).to(dtype).to(DEVICE), 1e-6) if folded else None

    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    q_rot = rotary_store_kv(positions, q, k, v, cos, sin, k_ref, v_ref, out_loc, norm, row_norm)
    args = (case.token_table, case.rows, seq_lens, 0.125)
    expected = decode_attention(q_rot, k_ref, v_ref, *args, num_splits=splits)

    k_new, v_new = case.k_cache.clone(), case.v_cache.clone()
    k_new[out_loc], v_new[out_loc] = float("nan"), float("nan")  # must be written before they are read
    rope = DecodeRope(positions, k, v, cos, sin, out_loc, norm, row_norm)
    got = decode_attention(q, k_new, v_new, *args, num_splits=splits, rope=rope)
    assert torch.equal(got, expected)
    # The unused pages stay NaN (build_case poisons them): NaN == NaN here.
    torch.testing.assert_close(k_new, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_new, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("qk_norm,folded", [(False, False), (True, False), (True, True)])
def test_rope_in_decode_matches_two_launches(splits: int, qk_norm: bool, folded: bool) -> None:
    _check((8, 2), 64, torch.float32, splits, qk_norm, folded)


@pytest.mark.parametrize("heads,head_dim,dtype", [((3, 1), 128, torch.float16), ((4, 4), 64, torch.float32)])
def test_rope_in_decode_other_shapes(heads: tuple[int, int], head_dim: int, dtype: torch.dtype) -> None:
    _check(heads, head_dim, dtype, 2, True, True)


def test_rope_in_decode_padding_entry() -> None:
    _check((8, 2), 64, torch.float32, 2, True, True, padded=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("splits,qk_norm,folded", list(itertools.product([1, 2, 8], [False, True], [False, True])))
def test_rope_in_decode_gpu(splits: int, qk_norm: bool, folded: bool) -> None:
    _check((16, 8), 128, torch.bfloat16, splits, qk_norm, folded)
    _check((16, 8), 128, torch.bfloat16, splits, qk_norm, folded, padded=True)
