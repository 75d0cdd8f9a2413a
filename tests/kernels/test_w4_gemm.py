"""W4A16 dequant-GEMM (`kernels/w4_gemm.py`) against its torch reference (`kernels/w4_ref.py`).

Without CUDA the kernel runs in Triton's interpreter on small shapes (fp32, fp16 and bf16: the
kernel widens 16-bit tiles to fp32 there, as the interpreter's bf16 dot is wrong, and its bf16
casts truncate, so bf16 is checked to a few ulp there and to one on the GPU); the `gpu`
tests run the 8B model's projection shapes in bf16 and fp16, act-order included, and the whole
tiny model through the engine on CUDA (tests/golden/test_w4_checkpoints.py has it on CPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels import w4_gemm as w4_gemm_module
from minisgl.kernels.w4_gemm import w4_gemm
from minisgl.kernels.w4_ref import W4Weight, dequantize, pack_rows, w4_linear_ref

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA and not w4_gemm_module._INTERPRETED,
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _weight(k: int, n: int, group: int, act_order: bool, seed: int, device: torch.device = DEVICE) -> W4Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 17, (groups, n), generator=gen).to(torch.uint8)  # 16: GPTQ v1's stored 15
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group).to(torch.int32)
    return W4Weight(pack_rows(q), scales, zeros, g_idx, group, k).to(device)


def _expected(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """The reference's dequantized weight (rounded to x's dtype), accumulated in fp32."""
    return (x.float() @ dequantize(w, x.dtype).float().T).to(x.dtype)


CPU_CASES = [  # (rows, K, N, group, act-order)
    (1, 64, 48, 32, False),
    (5, 200, 104, 32, False),  # K not a multiple of 8 or of the group, N of the tile
    (33, 128, 64, 128, True),
    (17, 96, 72, 32, True),
]


@pytest.mark.parametrize("rows, k, n, group, act_order", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_w4_gemm_matches_reference(rows: int, k: int, n: int, group: int, act_order: bool, dtype: torch.dtype) -> None:
    w = _weight(k, n, group, act_order, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    out = w4_gemm(x, w)
    assert out.shape == (rows, n) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, w4_linear_ref(x, w), rtol=1e-5, atol=1e-5)
    else:  # fp32 sums in another order, each rounded once to 16 bits: at most an ulp apart
        expected = _expected(x, w).float()
        ulp = torch.finfo(dtype).eps * expected.abs().max()
        # The interpreter casts to bf16 by truncation (the GPU rounds): a few ulp there.
        ulps = 4 if dtype == torch.bfloat16 and not CUDA else 1
        assert (out.float() - expected).abs().max() <= ulps * ulp


def test_w4_gemm_bias_and_leading_dims() -> None:
    w = _weight(64, 40, 32, False, seed=3)
    x = torch.randn(2, 3, 64, device=DEVICE)
    bias = torch.randn(40, device=DEVICE)
    torch.testing.assert_close(w4_gemm(x, w, bias), w4_linear_ref(x, w, bias), rtol=1e-5, atol=1e-5)
    assert w4_gemm(x[:0, 0], w).shape == (0, 40)


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
@pytest.mark.parametrize("n, k", [(4096 + 2 * 1024, 4096), (4096, 4096), (2 * 12288, 4096), (4096, 12288)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4_gemm_gpu_shapes(rows: int, n: int, k: int, act_order: bool, dtype: torch.dtype) -> None:
    w = _weight(k, n, 128, act_order, seed=rows, device=torch.device("cuda"))
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    out = w4_gemm(x, w)
    expected = _expected(x, w)
    rel = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert rel < 1e-2, f"max relative error {rel:.2e}"
