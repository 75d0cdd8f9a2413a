"""The C++ CPU extend (prefill) attention kernel (kernels/cpu_extend.py) against a torch reference
(gather each request's keys, SDPA in fp32 with the causal-with-prefix mask) on random pools with
shuffled slots, requests of mixed cached-prefix and extend lengths (1-token extends mixed with
chunks), GQA groups 1/3/4, head_dim 64/128, fp32/bf16/fp16 pages, on every ISA path this CPU runs
and on the portable-only build; bad input raises; the torch backend routes plain extend layers to it.

Tolerances: fp32 differs from the reference by summation order and exp's ~1e-7 error (a wrong
index, mask or missed block is off by orders of magnitude more); a bf16 q gets a bf16 output, one
rounding of the fp32 result: within one bf16 ulp of the reference's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpp_ext, cpu_extend
from tests.cpu_build import build

PATHS = ["avx512bf16", "avx512", "avx2", "portable"]
# (cached prefix, new tokens) per request: 1-token extends, chunks over a prefix, fresh prompts,
# lengths on and off the 32-key blocks and the query blocks
REQUESTS = [(0, 37), (100, 1), (50, 80), (0, 1), (200, 64), (13, 5), (0, 130), (31, 33), (7, 1), (64, 21)]


@pytest.fixture(scope="module")
def lib() -> cpp_ext.CpuKernels:
    return build(cpp_ext.load_library)


@pytest.fixture(scope="module")
def portable_lib() -> cpp_ext.CpuKernels:
    return build(cpp_ext.load_library, portable_only=True)


def _case(kv_dtype: torch.dtype, q_dtype: torch.dtype, group: int, dim: int, hkv: int = 2,
          requests: list[tuple[int, int]] = REQUESTS):  # fmt: skip
    torch.manual_seed(group * 1000 + dim)
    slots_total = 2048
    k_cache = torch.randn(slots_total, hkv, dim).to(kv_dtype)
    v_cache = torch.randn(slots_total, hkv, dim).to(kv_dtype)
    table = torch.zeros(len(requests) + 3, 512, dtype=torch.int32)
    perm = torch.randperm(slots_total)  # every request's slots shuffled over the pool
    rows = torch.tensor([len(requests) + 2 - i for i in range(len(requests))])  # rows out of order
    used = 0
    for i, (prefix, ext) in enumerate(requests):
        n = prefix + ext
        table[rows[i], :n] = perm[used : used + n].int()
        used += n
    total = sum(e for _, e in requests)
    q = (torch.randn(total, hkv * group, dim) * 2).to(q_dtype)
    seq_lens = torch.tensor([p + e for p, e in requests], dtype=torch.int32)
    ext_lens = torch.tensor([e for _, e in requests], dtype=torch.int32)
    return q, k_cache, v_cache, table, rows, seq_lens, ext_lens


def _reference(q, k_cache, v_cache, table, rows, seq_lens, ext_lens, scale: float) -> torch.Tensor:
    """Per request: its keys gathered, repeated per group, SDPA in fp32 with the causal-with-prefix mask."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    start = 0
    for row, n, e in zip(rows.tolist(), seq_lens.tolist(), ext_lens.tolist()):
        slots = table[row, :n].long()
        k = k_cache.index_select(0, slots).float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        v = v_cache.index_select(0, slots).float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        qi = q[start : start + e].float().transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - e, n)[:, None]
        out[start : start + e] = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        start += e
    return out


def _check(lib: cpp_ext.CpuKernels, isa: str, kv_dtype: torch.dtype, q_dtype: torch.dtype, group: int, dim: int):
    q, k_cache, v_cache, table, rows, seq_lens, ext_lens = _case(kv_dtype, q_dtype, group, dim)
    scale = dim**-0.5
    out = lib.extend_attention(q, k_cache, v_cache, table, rows, seq_lens, ext_lens, scale, isa=isa)
    ref = _reference(q, k_cache, v_cache, table, rows, seq_lens, ext_lens, scale)
    assert out.shape == q.shape and out.dtype == q_dtype
    if q_dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    else:
        diff = (out.float() - ref).abs()
        assert torch.all(diff <= ref.abs().clamp_min(2**-100) * 2**-7 + 1e-6), f"max diff {diff.max().item()}"


def _need(lib: cpp_ext.CpuKernels, isa: str) -> None:
    if isa not in lib.supported:
        pytest.skip(f"this CPU has no {isa} (it runs: {', '.join(lib.supported)})")


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("isa", PATHS)
def test_kernel_matches_reference(lib: cpp_ext.CpuKernels, isa: str, kv_dtype: torch.dtype, group: int, dim: int):
    _need(lib, isa)
    _check(lib, isa, kv_dtype, torch.float32, group, dim)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("isa", PATHS)
def test_bf16_queries(lib: cpp_ext.CpuKernels, isa: str, kv_dtype: torch.dtype) -> None:
    _need(lib, isa)
    _check(lib, isa, kv_dtype, torch.bfloat16, 3, 64)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_portable_only_build(portable_lib: cpp_ext.CpuKernels, kv_dtype: torch.dtype) -> None:
    assert portable_lib.supported == ("portable",)
    _check(portable_lib, "portable", kv_dtype, torch.float32, 3, 64)


def test_large_group_and_fp16_extremes(lib: cpp_ext.CpuKernels) -> None:
    """G = 16 (one query per task block on AVX2), and fp16 pages holding subnormals and large values."""
    q, k_cache, v_cache, table, rows, seq_lens, ext_lens = _case(torch.float32, torch.float32, 16, 64, hkv=1,
                                                                 requests=[(40, 3), (0, 9)])  # fmt: skip
    k16 = (k_cache * 100).to(torch.float16)
    v16 = torch.where(torch.rand(v_cache.shape) < 0.3, v_cache * 1e-6, v_cache * 1000).to(torch.float16)
    assert (v16.abs() < 6.1e-5).any() and (v16 != 0).any()  # subnormal halves present
    q = q * 0.01
    for isa in lib.supported:
        out = lib.extend_attention(q, k16, v16, table, rows, seq_lens, ext_lens, 0.125, isa=isa)
        ref = _reference(q, k16, v16, table, rows, seq_lens, ext_lens, 0.125)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-4)


def test_bad_input_raises(lib: cpp_ext.CpuKernels) -> None:
    q, k_cache, v_cache, table, rows, seq_lens, ext_lens = _case(torch.float32, torch.float32, 3, 64)
    with pytest.raises(RuntimeError, match="summing to T"):
        lib.extend_attention(q[:-1], k_cache, v_cache, table, rows, seq_lens, ext_lens, 0.125)
    too_long = ext_lens.clone()
    too_long[0] = seq_lens[0] + 1
    with pytest.raises(RuntimeError, match="outside the token table"):
        lib.extend_attention(q, k_cache, v_cache, table, rows, seq_lens, too_long, 0.125)
    bad_rows = rows.clone()
    bad_rows[1] = table.shape[0]
    with pytest.raises(RuntimeError, match="outside the token table"):
        lib.extend_attention(q, k_cache, v_cache, table, bad_rows, seq_lens, ext_lens, 0.125)
    with pytest.raises(RuntimeError, match="D % 16"):
        lib.extend_attention(q[..., :40], k_cache[..., :40], v_cache[..., :40], table, rows, seq_lens, ext_lens, 0.1)
    with pytest.raises(RuntimeError, match="one dtype"):
        lib.extend_attention(q, k_cache, v_cache.half(), table, rows, seq_lens, ext_lens, 0.125)
    assert cpu_extend.supports(64) and cpu_extend.supports(80) and not cpu_extend.supports(72)


def test_backend_routes_plain_extend_layers_to_the_kernel() -> None:
    """TorchAttnBackend over a bf16 pool: plain layers of an extend step take the kernel and match
    the per-request SDPA path within bf16 rounding; a windowed layer keeps the torch path; an fp32
    pool under the default kernel config (the exact mode) never takes it."""
    from minisgl.attention.base import AttnLayerSpec
    from minisgl.attention.batch import ForwardBatch
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.kvcache.pool import KVPool
    from minisgl.platform import current
    from minisgl.platform.kernel_config import KernelConfig

    platform, previous = current(), current().kernels
    platform.use_kernels(KernelConfig())  # the default config (an engine built earlier may have set its own)
    try:
        fp32 = KVPool(1, 8, 16, 3, 64, torch.float32, torch.device("cpu"))
        assert not TorchAttnBackend(fp32, 9, 3, 64, 0.125).cpu_extend
    finally:
        platform.use_kernels(previous)
    torch.manual_seed(0)
    seq_lens, extend_lens, page = [40, 7, 130, 65], [40, 1, 50, 65], 16
    pool = KVPool(2, 64, page, 3, 64, torch.bfloat16, torch.device("cpu"))
    for layer in range(2):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape))
    pages = torch.randperm(64)
    table = torch.zeros(len(seq_lens), 256, dtype=torch.int32)
    pos = torch.arange(256)
    for row in range(len(seq_lens)):
        table[row] = (pages[row * 16 : (row + 1) * 16][pos // page] * page + pos % page).int()
    out_loc = torch.cat([table[r, s - e : s] for r, (s, e) in enumerate(zip(seq_lens, extend_lens))]).long()
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    batch = ForwardBatch(
        phase="extend", input_ids=torch.zeros(len(out_loc), dtype=torch.int64),
        positions=torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)]), out_loc=out_loc,
        rows=torch.arange(len(seq_lens)), seq_lens=i32(seq_lens), extend_lens=i32(extend_lens),
        extend_starts=i32(starts), token_table=table, seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens,
        sample_idx=torch.zeros(1, dtype=torch.int64),
    )  # fmt: skip
    q = torch.randn(len(out_loc), 9, 64).to(torch.bfloat16)
    k, v = (torch.randn(len(out_loc), 3, 64).to(torch.bfloat16) for _ in range(2))
    outs = {}
    for use_kernel in (True, False):
        backend = TorchAttnBackend(pool, 9, 3, 64, 0.125)
        assert backend.cpu_extend
        backend.cpu_extend = use_kernel
        backend.configure_layer(1, AttnLayerSpec(sliding_window=8))
        backend.prepare(batch)
        calls = []
        lib = backend.cpu_lib  # the handle the backend calls (the shared library object)
        assert lib is not None
        original = lib.extend_attention
        lib.extend_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)  # type: ignore[method-assign]
        try:
            outs[use_kernel] = [backend.forward(q, k, v, layer, batch).clone() for layer in range(2)]
        finally:
            del lib.extend_attention  # the class's method again
        assert len(calls) == (1 if use_kernel else 0)  # layer 0 only: the windowed layer keeps torch
        batch.attn_meta = None
    torch.testing.assert_close(outs[True][0].float(), outs[False][0].float(), atol=3e-2, rtol=2e-2)
    assert torch.equal(outs[True][1], outs[False][1])
