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


_COMPILE_FOR_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl.kernels.fp8_gemm import PROMOTE_EVERY, _fp8_gemm_kernel
counts = {}
for grouped in (False, True):
    sig = {name: "*fp8e4nv" if name in ("a_ptr", "b_ptr") else "*fp32" for name in
           ("a_ptr", "as_ptr", "b_ptr", "bs_ptr", "c_ptr", "bias_ptr")}
    sig.update({name: "i32" for name in ("M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_asm", "stride_bsn")})
    consts = dict(GROUPED=grouped, HAS_BIAS=False, IMPRECISE_ACC=min(PROMOTE_EVERY, 128), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)
    sig.update({name: "constexpr" for name in consts})
    kernel = triton.compile(ASTSource(fn=_fp8_gemm_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    counts[str(grouped)] = [ptx.count("wgmma.mma_async"), ptx.count("add.f32")]
print(json.dumps(counts))
"""


def test_sm90_build_promotes_each_wgmma_partial_sum() -> None:
    """Compiled for sm90 (no GPU needed: Triton's own ptxas), the prefill tile (128 x 128, K step
    128, 8 warps: 64 fp32 accumulators a thread) adds each float8 WGMMA's partial sum to the fp32
    accumulator: K step / PROMOTE_EVERY adds a step (the grouped path's last one is its scaled
    FMA). Triton's sm90 default leaves the sum in the ~14-bit float8 accumulator and emits none:
    the H200 failure at 100 and 1000 rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from minisgl.kernels.fp8_gemm import PROMOTE_EVERY

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    steps = 128 // PROMOTE_EVERY
    wgmma, adds = counts["False"]
    assert wgmma == 128 // 32 and adds >= steps * 64, counts
    wgmma, adds = counts["True"]
    assert wgmma == 128 // 32 and adds >= (steps - 1) * 64, counts


@pytest.mark.parametrize("device", DEVICES)
def test_column_major_scales_equal_row_major(device: str) -> None:
    """cuBLAS's block-scaled GEMM reads the activation scales G-major: the same values."""
    from minisgl.kernels.fp8_gemm import fp8_quantize

    x = torch.randn(5, 384, device=device) * torch.logspace(-2, 2, 384, device=device)
    q, scale = fp8_quantize(x, 128)
    q_cm, scale_cm = fp8_quantize(x, 128, column_major=True)
    assert scale_cm.stride() == (1, 5) and torch.equal(scale_cm, scale) and torch.equal(q_cm.view(torch.uint8), q.view(torch.uint8))


def test_block_scales_are_found_only_where_rows_repeat_them() -> None:
    from minisgl.kernels.fp8_gemm import block_scales

    blocks = torch.rand(3, 4) + 0.1
    rows = blocks.repeat_interleave(128, dim=0)  # a 384 x 512 weight's scales, one per row
    assert torch.equal(block_scales(rows, 128), blocks)
    fused = torch.cat([blocks[:1].repeat_interleave(64, dim=0), rows[64:]])  # a part boundary mid-block
    fused[:64] *= 2
    assert block_scales(fused, 128) is None
    assert block_scales(rows[:200], 128) is None  # rows not a multiple of 128
    assert block_scales(rows[:, :1], None) is None and block_scales(rows, 64) is None
