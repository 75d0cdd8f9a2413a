"""The MoE top-k sum (`moe.sum_pairs`): the down kernel's [T * K, H] rows summed per token in
fp32, in k order, rounded once, as `moe_ref`'s `.view(T, K, H).sum(dim=1)` computes it.

Without CUDA the kernel runs in Triton's interpreter (fp32 and fp16: the interpreter mis-rounds
bf16); the `gpu` test checks bf16 at the decode and prefill sizes of Qwen3-30B-A3B's shape.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels.moe import _sum_pairs_kernel, sum_pairs  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not CUDA and type(_sum_pairs_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported in compiled mode before this module could select the interpreter",
)


def _expected(pairs: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """fp32 sums in k order, one rounding at the end."""
    acc = torch.zeros(tokens, pairs.shape[-1], dtype=torch.float32, device=pairs.device)
    for k in range(top_k):
        acc += pairs.view(tokens, top_k, -1)[:, k].float()
    return acc.to(pairs.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 2, 64), (5, 8, 48), (9, 3, 1040), (17, 8, 2048)])
def test_sum_pairs_equals_k_order_sum(tokens: int, top_k: int, hidden: int, dtype: torch.dtype) -> None:
    """Ragged hidden sizes (48, 1040: not a power of two, two column tiles), token counts not a
    multiple of the token tile, and K = 2, 3, 8; equal to the k-order fp32 sum bit for bit, and
    to the reference's torch sum within one rounding step."""
    torch.manual_seed(tokens * 100 + hidden)
    pairs = torch.randn(tokens * top_k, hidden, dtype=dtype, device=DEVICE)
    out = sum_pairs(pairs, tokens, top_k)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, _expected(pairs, tokens, top_k), atol=0, rtol=0)
    torch.testing.assert_close(out, pairs.view(tokens, top_k, hidden).sum(dim=1), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 256, 16384])
def test_gpu_sum_pairs_bf16(tokens: int) -> None:
    pairs = torch.randn(tokens * 8, 2048, dtype=torch.bfloat16, device=DEVICE)
    torch.testing.assert_close(sum_pairs(pairs, tokens, 8), _expected(pairs, tokens, 8), atol=0, rtol=0)
