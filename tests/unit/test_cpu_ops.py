"""The bf16 C++ CPU kernels (`kernels/cpu_ops.py`) against their plain-torch references, the
fallback to the references for anything but bf16, and the layers' choice of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_ops
from minisgl.kernels.activation_ref import silu_and_mul_ref
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="the C++ kernels could not be built here")

BF16 = torch.bfloat16


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding points as the reference: equal, except where fp32 summation order or exp's
    last bit tips a bf16 rounding (then one bf16 ulp, on a tiny fraction of elements)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == BF16
    diff = (out.float() - ref.float()).abs()
    ulp = ref.float().abs().clamp_min(2**-126) * 2**-7
    assert torch.all(diff <= ulp), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 64), (3, 1000)])
def test_rms_norm_and_add(tokens: int, hidden: int) -> None:
    torch.manual_seed(tokens)
    x, res = torch.randn(tokens, hidden).to(BF16) * 3, torch.randn(tokens, hidden).to(BF16)
    w = torch.randn(hidden).to(BF16)
    assert_bf16_close(cpu_ops.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    out, total = cpu_ops.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_total = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(total, ref_total)
    assert_bf16_close(out, ref_out)
    # Per-head view (Qwen3's q/k norms go through rotary, but the plain call must work too).
    heads = x[:, : hidden // 8 * 8].reshape(tokens, 8, hidden // 8)
    assert_bf16_close(cpu_ops.rms_norm(heads, w[: hidden // 8], 1e-6), rms_norm_ref(heads, w[: hidden // 8], 1e-6))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_on_fused_qkv_views(qk_norm: bool) -> None:
    torch.manual_seed(3)
    tokens, hq, hk, d = 4, 9, 3, 64
    qkv = torch.randn(tokens, (hq + 2 * hk) * d).to(BF16)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    angles = torch.outer(torch.arange(200).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 7, 199, 42])
    before = qkv.clone()
    if qk_norm:
        qw, kw = torch.randn(d).to(BF16), torch.randn(d).to(BF16)
        got = cpu_ops.qk_norm_rotary(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-5)
        want = qk_norm_rotary_ref(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-5)
    else:
        got = cpu_ops.rotary(positions, q, k, cos, sin)
        want = rotary_ref(positions, q, k, cos, sin)
    for g, w in zip(got, want):
        assert_bf16_close(g, w)
    assert torch.equal(qkv, before), "the inputs are read, not rotated in place"


def test_silu_and_mul() -> None:
    torch.manual_seed(4)
    for shape in [(1, 2 * 1536), (7, 2 * 96), (2, 3, 2 * 40)]:
        x = (torch.randn(shape) * 4).to(BF16)
        assert_bf16_close(cpu_ops.silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("n,k", [(960, 576), (17, 33), (49152 // 16, 576), (576, 1536)])
def test_gemv_one_row(n: int, k: int) -> None:
    torch.manual_seed(n)
    x, w, bias = torch.randn(1, k).to(BF16), torch.randn(n, k).to(BF16), torch.randn(n).to(BF16)
    exact = F.linear(x.double(), w.double())
    out = cpu_ops.linear(x, w)
    assert out.shape == (1, n) and out.dtype == BF16
    # fp32 accumulation, one rounding to bf16: within half a bf16 ulp plus fp32 summation noise.
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * k**0.5)
    with_bias = cpu_ops.linear(x, w, bias)
    assert torch.equal(with_bias, (out + bias)), "bias: F.linear's out + bias in bf16"


@pytest.mark.parametrize("rows", [2, 7, 13, cpu_ops.SMALL_GEMM_ROWS])
def test_small_gemm(rows: int) -> None:
    module = cpu_ops.load()
    if not module.has_bf16_dot():
        pytest.skip("no AVX-512 BF16 on this CPU: small batches keep F.linear")
    torch.manual_seed(rows)
    n, k = 4 * 37 + 3, 96  # a partial last block of weight rows
    x, w, bias = torch.randn(rows, k).to(BF16), torch.randn(n, k).to(BF16), torch.randn(n).to(BF16)
    exact = F.linear(x.double(), w.double())
    out = cpu_ops.linear(x, w)
    assert out.shape == (rows, n)
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * k**0.5)
    # Each row equals the one-row GEMV of that row (same fp32 dot products, same rounding).
    for i in (0, rows - 1):
        assert torch.allclose(out[i : i + 1].float(), cpu_ops.linear(x[i : i + 1], w).float(), rtol=2**-7, atol=1e-2)
    assert torch.equal(cpu_ops.linear(x, w, bias), out + bias)


def test_other_inputs_take_the_references() -> None:
    """fp32 (the exact mode) and batched rows never reach the C++ kernels."""
    torch.manual_seed(5)
    x32, w32 = torch.randn(1, 64), torch.randn(32, 64)
    assert torch.equal(cpu_ops.linear(x32, w32), F.linear(x32, w32))
    rows, w16 = torch.randn(cpu_ops.SMALL_GEMM_ROWS + 1, 64).to(BF16), w32.to(BF16)
    assert torch.equal(cpu_ops.linear(rows, w16), F.linear(rows, w16))
    assert torch.equal(cpu_ops.rms_norm(x32, torch.ones(64), 1e-6), rms_norm_ref(x32, torch.ones(64), 1e-6))
    g = torch.randn(2, 128)
    assert torch.equal(cpu_ops.silu_and_mul(g), silu_and_mul_ref(g))


def test_layers_choose_cpu_kernels_in_bf16_only() -> None:
    from minisgl.layers.activation import SiluAndMul
    from minisgl.layers.linear import ColumnParallelLinear
    from minisgl.layers.norm import RMSNorm
    from minisgl.layers.rotary import RotaryEmbedding

    default = torch.get_default_dtype()
    try:
        with torch.device("cpu"):
            torch.set_default_dtype(BF16)
            assert RMSNorm(16, 1e-6).impl == "cpu"
            assert RotaryEmbedding(16, 32, 10000.0, None).impl == "cpu"
            assert SiluAndMul().impl == "cpu"
            assert ColumnParallelLinear(64, 32)._linear is cpu_ops.linear
            torch.set_default_dtype(torch.float32)
            assert RMSNorm(16, 1e-6).impl == "torch"
            assert SiluAndMul().impl == "torch"
            assert ColumnParallelLinear(64, 32)._linear is F.linear
    finally:
        torch.set_default_dtype(default)


def test_bad_shapes_raise_instead_of_crashing() -> None:
    """Shapes the kernels cannot take are refused with an error (no division by zero, no reads
    past a buffer); the wrappers send odd head sizes and non-fp32 tables to the references."""
    module = cpu_ops.load()
    empty = torch.empty(2, 0, dtype=BF16)
    with pytest.raises(RuntimeError, match="shapes"):
        module.add_rms_norm(empty, empty.clone(), torch.empty(0, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="shapes"):
        module.rms_norm(empty, torch.empty(0, dtype=BF16), 1e-6)
    q, k = torch.randn(1, 2, 7).to(BF16), torch.randn(1, 1, 7).to(BF16)
    cos = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="even D"):
        module.rotary(torch.tensor([1]), q, k, cos, cos, None, None, 0.0, 0.0)
    q8, k8 = torch.randn(1, 2, 8).to(BF16), torch.randn(1, 1, 8).to(BF16)
    with pytest.raises(RuntimeError, match="norm weights"):
        module.rotary(torch.tensor([1]), q8, k8, torch.randn(4, 4), torch.randn(4, 4), torch.ones(4, dtype=BF16), torch.ones(4, dtype=BF16), 1e-6, 1e-6)
    # Through the wrapper, tables of another dtype take the reference.
    cos64, sin64 = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    got = cpu_ops.rotary(torch.tensor([1]), q8, k8, cos64, sin64)
    want = rotary_ref(torch.tensor([1]), q8, k8, cos64, sin64)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
