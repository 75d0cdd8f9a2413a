"""The Triton FP8 GEMM (kernels/fp8_gemm.py) at the row counts the H200 run failed at, under the
interpreter on CPU (compiled on CUDA): several BLOCK_M tiles with a partial last one, K not a
multiple of 128, per-channel and per-128-group scales. The interpreter passing while the GPU
failed is what located the GPU failure in the sm90 float8 accumulator (`PROMOTE_EVERY`), not in
the tiling, masks or scale strides."""

from __future__ import annotations

import os

import pytest
import torch

from minisgl.kernels.fp8_ref import dequantize_fp8, quantize_fp8, quantize_weight_blocks

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRETED, reason="triton is compiled in this session")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("rows", [100, 300])
def test_gemm_over_several_row_tiles_equals_the_reference(group: int | None, rows: int, device: str) -> None:
    from minisgl.kernels.fp8_gemm import fp8_gemm

    n, k = 48, 1000
    torch.manual_seed(rows)
    w = torch.randn(n, k, device=device) * 0.02
    if group is None:
        qw, ws = quantize_fp8(w)
    else:
        qw, blocks = quantize_weight_blocks(w, (128, 128))
        ws = blocks.repeat_interleave(128, dim=0)[:n].contiguous()
    x = torch.randn(rows, k, device=device)
    x[rows // 2] *= 1000.0  # one row's scale far from the others': a row/scale stride mix-up shows
    xq, xs = quantize_fp8(x, group)
    expected = dequantize_fp8(xq, xs, group).double() @ dequantize_fp8(qw, ws, group).double().t()
    out = fp8_gemm(xq, xs, qw, ws, group, torch.float32)
    scale = expected.abs().amax(dim=1, keepdim=True)  # per row: the big row must not hide the others
    # 1e-4 of the row: fp32 summation order, and on sm90 the float8 WGMMA partial sums of 32 products
    torch.testing.assert_close(out.double() / scale, expected / scale, rtol=0, atol=1e-4)
