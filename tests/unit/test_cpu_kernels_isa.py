"""Every float C++ CPU kernel (kernels/cpp_ext.py) on every code path this CPU runs (avx512bf16,
avx512, avx2, portable), in fp32 and bf16, against the plain-torch references, on odd sizes (hidden not a
multiple of 16, head_dim 64/128/72, vector tails); the `set_isa` switch; and the portable path
built alone (no x86 code or flags, what a non-x86 target gets), tested the same way.

Tolerances: bf16 has the references' rounding points, so outputs are equal except where fp32
summation order or exp's last bit tips one bf16 rounding (then one ulp, on under 1% of elements).
fp32 differs from the reference only by summation order and exp's ~1e-7 error: within 1e-5
relative (a wrong index or a missed tail is off by orders of magnitude more); the fp32 rotary,
which sums nothing, is bit-equal.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpp_ext, cpu_ops
from minisgl.kernels.activation_ref import silu_and_mul_ref
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref
from tests.cpu_build import build, scattered_table

BF16, F32 = torch.bfloat16, torch.float32
PATHS = ["avx512bf16", "avx512", "avx2", "portable"]
DTYPES = [F32, BF16]


@pytest.fixture(scope="module")
def lib() -> cpp_ext.CpuKernels:
    return build(cpp_ext.load_library)


@pytest.fixture(scope="module")
def portable_lib() -> cpp_ext.CpuKernels:
    return build(cpp_ext.load_library, portable_only=True)


def _need(lib: cpp_ext.CpuKernels, isa: str) -> None:
    if isa not in lib.supported:
        pytest.skip(f"this CPU has no {isa} (it runs: {', '.join(lib.supported)})")


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == BF16:
        diff = (out.float() - ref.float()).abs()
        ulp = ref.float().abs().clamp_min(2**-126) * 2**-7
        assert torch.all(diff <= ulp), f"max diff {diff.max().item()}"
        assert (diff > 0).float().mean().item() < 0.01
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _norm_cases(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype) -> None:
    for tokens, hidden in ((1, 576), (5, 64), (3, 1000), (2, 37), (17, 13)):
        torch.manual_seed(tokens * hidden)
        x, res = (torch.randn(tokens, hidden) * 3).to(dtype), torch.randn(tokens, hidden).to(dtype)
        w = torch.randn(hidden).to(dtype)
        assert_close(lib.rms_norm(x, w, 1e-5, isa), rms_norm_ref(x, w, 1e-5))
        out, total = lib.add_rms_norm(x, res, w, 1e-6, isa)
        ref_out, ref_total = fused_add_rms_norm_ref(x, res, w, 1e-6)
        assert torch.equal(total, ref_total)
        assert_close(out, ref_out)
        wide = torch.randn(tokens, hidden * 2).to(dtype)[:, 1 : hidden + 1]  # strided rows, odd offset
        assert_close(lib.rms_norm(wide, w, 1e-6, isa), rms_norm_ref(wide, w, 1e-6))


def _rotary_cases(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype) -> None:
    for d, qk_norm in ((64, False), (128, False), (72, False), (10, False), (64, True), (128, True), (72, True)):
        torch.manual_seed(d)
        tokens, hq, hk = 4, 9, 3
        qkv = torch.randn(tokens, (hq + 2 * hk) * d).to(dtype)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
        angles = torch.outer(torch.arange(200).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = angles.cos(), angles.sin()
        positions = torch.tensor([0, 7, 199, 42])
        if qk_norm:
            qw, kw = torch.randn(d).to(dtype), torch.randn(d).to(dtype)
            got = lib.rotary(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-5, isa=isa)
            want = qk_norm_rotary_ref(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-5)
        else:
            got = lib.rotary(positions, q, k, cos, sin, isa=isa)
            want = rotary_ref(positions, q, k, cos, sin)
        for g, w in zip(got, want):
            if dtype == F32 and not qk_norm:
                assert torch.equal(g, w), "fp32 rotary does the reference's operations: bit-equal"
            assert_close(g, w)
    with pytest.raises(RuntimeError, match="position out of the table"):
        lib.rotary(torch.tensor([0, 200, 1, 2]), q, k, cos, sin, isa=isa)


def _silu_cases(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    for shape in ((1, 2 * 1536), (7, 2 * 96), (2, 3, 2 * 40), (3, 2 * 7), (1, 2 * 1100)):
        x = (torch.randn(shape) * 4).to(dtype)
        assert_close(lib.silu_and_mul(x, isa), silu_and_mul_ref(x))
    edges = torch.tensor([[-100.0, -88.0, -20.0, 0.0, 1e-30, 20.0, 88.0, 100.0] * 2 + [1.5] * 16]).to(dtype)
    out = lib.silu_and_mul(edges, isa)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), silu_and_mul_ref(edges).float(), rtol=1e-2, atol=1e-30)


def _linear_cases(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype) -> None:
    for rows, n, k in ((1, 960, 576), (1, 17, 33), (2, 151, 96), (7, 33, 100), (16, 64, 576), (3, 9, 7)):
        torch.manual_seed(rows * n + k)
        x, w, bias = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        exact = F.linear(x.double(), w.double())
        out = lib.gemm_rows(x, w, None, isa)
        assert out.shape == (rows, n) and out.dtype == dtype
        bound = x.double().abs() @ w.double().abs().T  # sum |x_i * w_i|: scales fp32 summation error
        if dtype == BF16:  # one rounding to bf16, plus fp32 summation noise
            assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * bound)
            assert torch.equal(lib.gemm_rows(x, w, bias, isa), out + bias), "bias: F.linear's out + bias in bf16"
        else:
            assert torch.all((out.double() - exact).abs() <= 1e-5 * bound)
            torch.testing.assert_close(lib.gemm_rows(x, w, bias, isa), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
        if rows == 1:
            assert torch.equal(lib.gemv(x, w, None, isa), out)


def _paged_case(dtype: torch.dtype, lens: list[int], hkv: int, group: int, dim: int):
    torch.manual_seed(len(lens) + dim + group)
    slots_total = 2048
    k_cache = torch.randn(slots_total, hkv, dim).to(dtype)
    v_cache = torch.randn(slots_total, hkv, dim).to(dtype)
    table, rows = scattered_table(lens, slots_total, 512)
    q = torch.randn(len(lens), hkv * group, dim).to(dtype)
    return q, k_cache, v_cache, table, rows, torch.tensor(lens, dtype=torch.int32)


def _attention_cases(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype) -> None:
    lens = [1, 7, 16, 17, 300, 64]
    for hkv, group, dim in ((3, 3, 64), (2, 8, 128), (1, 1, 72), (2, 4, 40)):
        q, k_cache, v_cache, table, rows, seq_lens = _paged_case(dtype, lens, hkv, group, dim)
        out = lib.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5, isa)
        assert out.shape == q.shape and out.dtype == dtype
        for i, n in enumerate(lens):
            slots = table[rows[i], :n].long()
            k = k_cache.index_select(0, slots).transpose(0, 1).float()
            v = v_cache.index_select(0, slots).transpose(0, 1).float()
            qi = q[i].view(1, hkv, group, dim).float()
            ref = F.scaled_dot_product_attention(qi, k[None], v[None], scale=dim**-0.5)  # group rows as queries
            tol = 1e-5 if dtype == F32 else 1.6e-2  # bf16: the output's own rounding
            torch.testing.assert_close(out[i].float(), ref.reshape(hkv * group, dim), atol=tol, rtol=tol)
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(dtype, [20, 30], 3, 3, 64)
    k_cache[table[rows[1], 3].long()] = float("nan")
    out = lib.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.125, isa)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any(), "a NaN key reaches its request's output"
    empty = lib.decode_attention(q, k_cache, v_cache, table, rows, torch.tensor([0, 5], dtype=torch.int32), 0.125, isa)
    assert torch.equal(empty[0], torch.zeros_like(empty[0])), "no keys: a zero output, not NaN"


def _sample_cases(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype) -> None:
    """The inverse CDF of each row's uniform: the index the float64 softmax/cumsum/searchsorted
    reference picks, except where the target lies within 1e-5 of a CDF step (summation order)."""
    gen = torch.Generator().manual_seed(5)
    for n in (1, 7, 255, 256, 257, 1000, 49157):
        x = (torch.randn(12, n + 3, generator=gen) * 3).to(dtype)[:, 2 : n + 2]  # strided rows
        x[0, max(1, n // 2) :] = float("-inf")  # a banned tail (logit controls, a grammar mask)
        temperature = torch.rand(12, generator=gen) * 1.9 + 0.05
        uniform = torch.rand(12, generator=gen)
        uniform[1], uniform[2] = 0.0, 1.0 - 2**-24  # the first and the last mass
        out = lib.sample(x, temperature, uniform, isa)
        assert out.dtype == torch.int64 and out.shape == (12,)
        cdf = torch.softmax(x.double() / temperature.double()[:, None], dim=-1).cumsum(-1)
        target = uniform.double() * cdf[:, -1]
        ref = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp(max=n - 1)
        for r in (out != ref).nonzero().flatten().tolist():
            gap = (cdf[r] - target[r]).abs().min().item()
            assert gap < 1e-5, f"n={n} row {r}: token {out[r].item()}, reference {ref[r].item()} (gap {gap:.2e})"
        assert torch.isfinite(x[torch.arange(12), out]).all(), "a banned (-inf) token was drawn"
    # No distribution: NaN or all -inf rows take the first largest logit (NaN ignored), or 0.
    bad = torch.zeros(3, 40, dtype=dtype)
    bad[0, 5], bad[0, 9] = float("nan"), 4.0
    bad[1] = float("-inf")
    bad[2, 17] = float("inf")
    out = lib.sample(bad, torch.ones(3), torch.full((3,), 0.5), isa)
    assert out.tolist() == [9, 0, 17]
    for temperature, uniform in ((torch.zeros(1), torch.zeros(1)), (torch.ones(1), torch.ones(1))):
        with pytest.raises(RuntimeError, match="sample: (temperatures|uniforms)"):
            lib.sample(torch.zeros(1, 8, dtype=dtype), temperature, uniform, isa)


CASES = {"norm": _norm_cases, "rotary": _rotary_cases, "silu": _silu_cases, "linear": _linear_cases,
         "attention": _attention_cases, "sample": _sample_cases}  # fmt: skip


@pytest.mark.parametrize("op", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", PATHS)
def test_op_matches_reference(lib: cpp_ext.CpuKernels, isa: str, dtype: torch.dtype, op: str) -> None:
    _need(lib, isa)
    CASES[op](lib, isa, dtype)


@pytest.mark.parametrize("op", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_portable_only_build(portable_lib: cpp_ext.CpuKernels, dtype: torch.dtype, op: str) -> None:
    assert portable_lib.compiled == ("portable",) and portable_lib.supported == ("portable",)
    assert not portable_lib.has_bf16_dot("portable")
    CASES[op](portable_lib, "portable", dtype)


def test_portable_only_build_has_no_avx(portable_lib: cpp_ext.CpuKernels) -> None:
    objdump = shutil.which("objdump")
    if objdump is None or not re.match(r"x86_64|amd64", __import__("platform").machine().lower()):
        pytest.skip("needs objdump on x86-64")
    text = subprocess.run([objdump, "-d", portable_lib.path], capture_output=True, text=True, check=True).stdout
    assert "minisgl_cpu_rms_norm" in text
    assert not re.search(r"%[yz]mm\d", text), "the portable-only build contains AVX/AVX-512 code"
    with pytest.raises(ValueError, match="unavailable"):
        portable_lib.silu_and_mul(torch.randn(1, 8), "avx2")


def test_set_isa_forces_a_path(lib: cpp_ext.CpuKernels) -> None:
    x = torch.randn(3, 2 * 100).to(BF16)
    assert lib.resolve("auto") == lib.best_isa() == lib.supported[-1]
    try:
        for isa in lib.supported:
            cpp_ext.set_isa(isa)
            assert lib.resolve() == isa
            assert torch.equal(lib.silu_and_mul(x), lib.silu_and_mul(x, isa))
            cpu_ops.set_isa(isa)  # the same switch through cpu_ops
            assert lib.resolve() == isa
        with pytest.raises(ValueError, match="isa must be one of"):
            cpp_ext.set_isa("sse4")  # type: ignore[arg-type]
        missing = [isa for isa in cpp_ext.ISAS if isa not in lib.supported]
        for isa in missing:
            with pytest.raises(ValueError, match="unavailable"):
                lib.silu_and_mul(x, isa)  # type: ignore[arg-type]
    finally:
        cpp_ext.set_isa("auto")
    assert lib.resolve() == lib.best_isa()


def test_paths_agree(lib: cpp_ext.CpuKernels) -> None:
    """The same inputs give near-identical outputs on every path (only summation order differs)."""
    torch.manual_seed(9)
    x, w = torch.randn(5, 300), torch.randn(300)
    outs = [lib.rms_norm(x, w, 1e-6, isa) for isa in lib.supported]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_fp32_wrappers_opt_in() -> None:
    """cpu_ops sends fp32 to the references (exact parity) unless set_fp32(True)."""
    if not cpu_ops.enabled():
        pytest.skip("the C++ kernels could not be built here")
    torch.manual_seed(2)
    x, w, g = torch.randn(3, 70), torch.randn(70), torch.randn(2, 2 * 90)
    cpu_ops.set_fp32(False)  # process-wide: an engine built earlier in this process may have set it
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    try:
        cpu_ops.set_fp32(True)
        assert_close(cpu_ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        assert_close(cpu_ops.silu_and_mul(g), silu_and_mul_ref(g))
        lib = cpu_ops.load()
        assert lib is not None
        assert torch.equal(cpu_ops.silu_and_mul(g), lib.silu_and_mul(g)), "fp32 now takes the C++ kernel"
    finally:
        cpu_ops.set_fp32(False)
    assert torch.equal(cpu_ops.silu_and_mul(g), silu_and_mul_ref(g))


def test_fp32_layers_pick_the_kernels_after_set_fp32() -> None:
    """Layers choose their implementation once, at build: an fp32 model built while fp32 goes to
    the C++ kernels (the GGUF engine's cpu_kernels_fp32) binds the norm, rotary and SiLU to them;
    one built without (the exact mode) binds the references."""
    from minisgl.layers.activation import make_act_and_mul
    from minisgl.layers.norm import RMSNorm
    from minisgl.layers.rotary import RotaryEmbedding

    if not cpu_ops.enabled():
        pytest.skip("the C++ kernels could not be built here")
    assert torch.get_default_dtype() == torch.float32

    def build() -> tuple[RMSNorm, RotaryEmbedding, torch.nn.Module]:
        return RMSNorm(64, 1e-6), RotaryEmbedding(64, 128, 10000.0, None), make_act_and_mul("silu")

    try:
        cpu_ops.set_fp32(True)
        norm, rotary, act = build()
        assert norm.impl == rotary.impl == "cpu" and norm._add_norm is cpu_ops.fused_add_rms_norm
        assert rotary._rotary is cpu_ops.rotary and act._fn is cpu_ops.silu_and_mul  # type: ignore[attr-defined]
    finally:
        cpu_ops.set_fp32(False)
    norm, rotary, act = build()
    assert norm.impl == rotary.impl == "torch" and norm._add_norm is fused_add_rms_norm_ref
    assert rotary._rotary is rotary_ref
