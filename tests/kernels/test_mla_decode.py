"""The Triton MLA decode kernel vs its torch reference, and the reference's absorbed attention vs
attention over the up-projected keys and values.

Without CUDA the kernel runs in Triton's interpreter on small shapes; the `gpu` tests take
DeepSeek's shapes (kv_lora_rank 512, rope 64) in bf16. Pages are shuffled and every cache slot
no request owns holds NaN, so a read outside a request's positions shows up in the output.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
# Without CUDA, tests/conftest.py has put triton in interpreter mode before this import.

from minisgl.kernels.attention import is_interpreted  # noqa: E402
from minisgl.kernels.attention.mla_decode import mla_decode  # noqa: E402
from minisgl.kernels.mla_ref import mla_decode_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _paged_case(
    seq_lens: list[int], heads: int, rank: int, rope: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """(q [B, H, L + R], cache [slots, L + R], token_table, rows, seq_lens) with each request's
    positions on shuffled slots, unowned slots NaN, and the rows in reverse order."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    num_slots = total + 7
    cache = torch.full((num_slots, rank + rope), float("nan"))
    perm = torch.randperm(num_slots, generator=gen)[:total]
    cache[perm] = torch.randn(total, rank + rope, generator=gen)
    table = torch.zeros(len(seq_lens) + 1, max(seq_lens + [1]) + 5, dtype=torch.int32)
    rows = list(range(len(seq_lens)))[::-1]
    offset = 0
    for row, seq_len in zip(rows, seq_lens):
        table[row, :seq_len] = perm[offset : offset + seq_len].int()
        offset += seq_len
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen)
    tensors = (q.to(dtype), cache.to(dtype), table, torch.tensor(rows), torch.tensor(seq_lens, dtype=torch.int32))
    return tuple(t.to(DEVICE) for t in tensors)


@pytest.mark.parametrize(
    ("seq_lens", "heads", "rank", "rope", "num_splits"),
    [
        ([5, 1, 37], 4, 32, 8, 1),
        ([5, 1, 37], 4, 32, 8, 3),
        ([20, 0, 9], 20, 48, 16, 2),  # heads past one block, a non-power-of-two rank, a padding entry
        ([64], 2, 16, 8, 4),
    ],
)
def test_mla_decode_matches_reference(seq_lens: list[int], heads: int, rank: int, rope: int, num_splits: int) -> None:
    q, cache, table, rows, lens = _paged_case(seq_lens, heads, rank, rope, torch.float32)
    scale = (rank // 2 + rope) ** -0.5
    expected = mla_decode_ref(q, cache, table, rows, lens, scale, rank)
    got = mla_decode(q, cache, table, rows, lens, scale, rank, num_splits=num_splits, block_n=16)
    assert not got.isnan().any(), "read a slot outside a request's positions"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if 0 in seq_lens:
        assert (got[seq_lens.index(0)] == 0).all(), "a length-0 (padding) entry must output zeros"


def test_absorbed_equals_up_projected_attention() -> None:
    """softmax([q_nope W_uk, q_rope] . [c, k_rope]) c W_uv == attention over k = [c W_uk^T, k_rope],
    v = c W_uv^T (what the extend path and Hugging Face compute)."""
    gen = torch.Generator().manual_seed(1)
    heads, nope, rope, rank, v_dim, seq = 3, 8, 4, 16, 6, 11
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, rank, generator=gen, dtype=torch.float64)
    latent = torch.randn(seq, rank, generator=gen, dtype=torch.float64)
    k_rope = torch.randn(seq, rope, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(heads, nope, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(heads, rope, generator=gen, dtype=torch.float64)
    scale = (nope + rope) ** -0.5
    keys = torch.cat([torch.einsum("hnl,sl->hsn", w_uk, latent), k_rope.expand(heads, -1, -1)], dim=-1)
    values = torch.einsum("hvl,sl->hsv", w_uv, latent)
    probs = torch.softmax(torch.einsum("hd,hsd->hs", torch.cat([q_nope, q_rope], -1), keys) * scale, -1)
    expected = torch.einsum("hs,hsv->hv", probs, values)
    q_abs = torch.cat([torch.einsum("hn,hnl->hl", q_nope, w_uk), q_rope], dim=-1)
    cache = torch.cat([latent, k_rope], dim=-1)
    table = torch.arange(seq, dtype=torch.int32)[None]
    out_lat = mla_decode_ref(q_abs[None], cache, table, torch.tensor([0]), torch.tensor([seq]), scale, rank)[0]
    # The reference's softmax runs in fp32 (as Hugging Face's), hence fp32 tolerances.
    torch.testing.assert_close(torch.einsum("hl,hvl->hv", out_lat, w_uv), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_decode_gpu_deepseek_shapes(heads: int, num_splits: int | None, dtype: torch.dtype) -> None:
    q, cache, table, rows, lens = _paged_case([1, 300, 2048, 77], heads, 512, 64, dtype)
    scale = 192**-0.5
    expected = mla_decode_ref(q.float(), cache.float(), table, rows, lens, scale, 512)
    got = mla_decode(q, cache, table, rows, lens, scale, 512, num_splits=num_splits)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
