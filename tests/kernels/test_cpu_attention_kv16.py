"""The C++ CPU decode attention over 16-bit K/V pages (fp16 and bf16) with fp32 (or bf16) q, on
every code path this CPU runs (avx512bf16, avx512, avx2 with F16C, portable) and on the portable
path built alone, against the reference: the pages dequantized to fp32, then fp32 SDPA.

Tolerances: with fp32 q the kernel and the reference attend over the same fp32 values (each
16-bit element converts exactly), so they differ only by summation order and exp's ~1e-7 error:
1e-5, as the fp32-page case (tests/unit/test_cpu_kernels_isa.py). A bf16 q rounds its output:
1.6e-2. The conversion itself is checked bit for bit on all 65,536 fp16 patterns (one key per
request: the output is that key's value row, times exactly 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpp_ext
from tests.cpu_build import build, scattered_table

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
PATHS = ["avx512bf16", "avx512", "avx2", "portable"]
SHAPES = ((3, 3, 64), (2, 8, 128), (1, 1, 72), (2, 4, 40), (1, 2, 10), (2, 1, 6))  # Hkv, group, head_dim
LENS = [1, 7, 16, 17, 300, 64]


@pytest.fixture(scope="module")
def lib() -> cpp_ext.CpuKernels:
    return build(cpp_ext.load_library)


@pytest.fixture(scope="module")
def portable_lib() -> cpp_ext.CpuKernels:
    return build(cpp_ext.load_library, portable_only=True)


def _paged_case(q_dtype: torch.dtype, kv_dtype: torch.dtype, lens: list[int], hkv: int, group: int, dim: int):
    torch.manual_seed(len(lens) + dim + group)
    slots_total = 2048
    # fp32 values rounded to the pages' type (nearest even), as KVPool.store writes them.
    k_cache = (torch.randn(slots_total, hkv, dim) * 2).to(kv_dtype)
    v_cache = torch.randn(slots_total, hkv, dim).to(kv_dtype)
    table, rows = scattered_table(lens, slots_total, 512)
    q = torch.randn(len(lens), hkv * group, dim).to(q_dtype)
    return q, k_cache, v_cache, table, rows, torch.tensor(lens, dtype=torch.int32)


def _reference(q, k_cache, v_cache, table, rows, n: int, i: int, hkv: int, group: int, dim: int) -> torch.Tensor:
    """Request i: its K/V pages dequantized to fp32, then fp32 SDPA (the group's rows as queries)."""
    slots = table[rows[i], :n].long()
    k = k_cache.index_select(0, slots).float().transpose(0, 1)
    v = v_cache.index_select(0, slots).float().transpose(0, 1)
    qi = q[i].float().view(1, hkv, group, dim)
    return F.scaled_dot_product_attention(qi, k[None], v[None], scale=dim**-0.5).reshape(hkv * group, dim)


def _cases(lib: cpp_ext.CpuKernels, isa: str, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    for hkv, group, dim in SHAPES:
        q, k_cache, v_cache, table, rows, seq_lens = _paged_case(q_dtype, kv_dtype, LENS, hkv, group, dim)
        out = lib.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5, isa)
        assert out.shape == q.shape and out.dtype == q_dtype
        tol = 1e-5 if q_dtype == F32 else 1.6e-2
        for i, n in enumerate(LENS):
            ref = _reference(q, k_cache, v_cache, table, rows, n, i, hkv, group, dim)
            torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol, msg=lambda m, d=dim: f"{isa} {d}: {m}")
        # Not a reading of the pages as another type: fp16 bits read as bf16 (or the reverse) are far off.
        other = BF16 if kv_dtype == F16 else F16
        wrong = _reference(q, k_cache.view(other), v_cache.view(other), table, rows, LENS[4], 4, hkv, group, dim)
        assert not torch.allclose(out[4].float(), wrong, atol=1e-2, rtol=1e-2)


def _nan_and_empty(lib: cpp_ext.CpuKernels, isa: str, kv_dtype: torch.dtype) -> None:
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(F32, kv_dtype, [20, 30], 3, 3, 64)
    k_cache[table[rows[1], 3].long()] = float("nan")
    out = lib.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.125, isa)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any(), "a NaN key reaches its request's output"
    empty = lib.decode_attention(q, k_cache, v_cache, table, rows, torch.tensor([0, 5], dtype=torch.int32), 0.125, isa)
    assert torch.equal(empty[0], torch.zeros_like(empty[0])), "no keys: a zero output, not NaN"


def _every_fp16_pattern(lib: cpp_ext.CpuKernels, isa: str) -> None:
    """V rows holding all 65,536 fp16 bit patterns (zeros, subnormals, normals, inf, NaN), one key
    per request: out = 1 * v exactly, so each element is the kernel's conversion of one pattern:
    at head_dim 64 the vector loads', at 6 the scalar tails'."""
    for dim in (64, 6):
        n = -(-65536 // dim)
        bits = torch.zeros(n * dim, dtype=torch.int32)
        bits[:65536] = torch.arange(65536, dtype=torch.int32)
        v_cache = bits.to(torch.int16).view(F16).view(n, 1, dim)
        k_cache = torch.ones(n, 1, dim, dtype=F16)
        table = torch.arange(n, dtype=torch.int32).view(n, 1)
        q = torch.randn(n, 1, dim)
        out = lib.decode_attention(q, k_cache, v_cache, table, torch.arange(n), torch.ones(n, dtype=torch.int32),
                                   0.125, isa)  # fmt: skip
        _equal_conversion(out, v_cache, isa)


def _equal_conversion(out: torch.Tensor, v_cache: torch.Tensor, isa: str) -> None:
    expected = v_cache.float()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], expected[~nan]), f"{isa}: fp16 -> fp32 is not exact"
    assert torch.isinf(out).sum().item() == 2 and (out[~nan].abs() < 2**-14).sum().item() >= 2048


@pytest.mark.parametrize("kv_dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("q_dtype", [F32, BF16], ids=["q_fp32", "q_bf16"])
@pytest.mark.parametrize("isa", PATHS)
def test_16bit_pages_match_dequantized_reference(lib, isa: str, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    if isa not in lib.supported:
        pytest.skip(f"this CPU has no {isa} (it runs: {', '.join(lib.supported)})")
    _cases(lib, isa, q_dtype, kv_dtype)
    _nan_and_empty(lib, isa, kv_dtype)


@pytest.mark.parametrize("isa", PATHS)
def test_fp16_conversion_is_exact(lib, isa: str) -> None:
    if isa not in lib.supported:
        pytest.skip(f"this CPU has no {isa} (it runs: {', '.join(lib.supported)})")
    _every_fp16_pattern(lib, isa)


@pytest.mark.parametrize("kv_dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_portable_only_build(portable_lib, kv_dtype: torch.dtype) -> None:
    assert portable_lib.supported == ("portable",)
    _cases(portable_lib, "portable", F32, kv_dtype)
    _nan_and_empty(portable_lib, "portable", kv_dtype)
    _every_fp16_pattern(portable_lib, "portable")


def test_paths_agree_on_fp16_pages(lib) -> None:
    """Every path gives near-identical outputs over the same fp16 pages (summation order only)."""
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(F32, F16, LENS, 3, 3, 64)
    outs = [lib.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.125, isa) for isa in lib.supported]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_bad_page_dtypes_raise(lib) -> None:
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(F32, F16, [5, 9], 3, 3, 64)
    with pytest.raises(RuntimeError, match="one dtype"):
        lib.decode_attention(q, k_cache, v_cache.to(BF16), table, rows, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        lib.decode_attention(q, k_cache.to(torch.float64), v_cache.to(torch.float64), table, rows, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        lib.decode_attention(q.to(F16), k_cache, v_cache, table, rows, seq_lens, 0.125)
