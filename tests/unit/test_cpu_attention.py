"""The C++ CPU decode-attention kernel against per-request SDPA over the same paged pool, and the
torch backend's choice of it (bf16 on CPU only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_attention
from tests.cpu_build import scattered_table

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="the C++ kernel could not be built here")


def _paged_case(dtype: torch.dtype, lens: list[int], hkv: int = 3, group: int = 3, dim: int = 64):
    torch.manual_seed(len(lens))
    slots_total = 4096
    k_cache = torch.randn(slots_total, hkv, dim).to(dtype)
    v_cache = torch.randn(slots_total, hkv, dim).to(dtype)
    table, rows = scattered_table(lens, slots_total, 1024)
    q = torch.randn(len(lens), hkv * group, dim).to(dtype)
    return q, k_cache, v_cache, table, rows, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa_per_request(dtype: torch.dtype) -> None:
    lens = [1, 7, 16, 17, 300, 64]
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(dtype, lens)
    out = cpu_attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(lens):
        slots = table[rows[i], :n].long()
        k = k_cache.index_select(0, slots).transpose(0, 1).float()
        v = v_cache.index_select(0, slots).transpose(0, 1).float()
        ref = F.scaled_dot_product_attention(q[i].view(1, 3, 3, 64).float(), k[None], v[None], scale=0.125)
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[i].float(), ref.reshape(9, 64), atol=tol, rtol=tol)


def test_backend_uses_the_kernel_for_bf16_only() -> None:
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.kvcache.pool import KVPool
    from minisgl.platform import current
    from minisgl.platform.kernel_config import KernelConfig

    platform, previous = current(), current().kernels
    platform.use_kernels(KernelConfig())  # the default config (an engine built earlier may have set its own)
    try:
        for dtype, expected in ((torch.bfloat16, True), (torch.float32, False)):
            pool = KVPool(2, 8, 16, 3, 64, dtype, torch.device("cpu"))
            assert TorchAttnBackend(pool, 9, 3, 64, 0.125).cpu_kernel is expected
    finally:
        platform.use_kernels(previous)


def test_bad_rows_and_lengths_raise() -> None:
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(torch.bfloat16, [5, 9])
    too_long = torch.tensor([5, table.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the token table"):
        cpu_attention.decode_attention(q, k_cache, v_cache, table, rows, too_long, 0.125)
    with pytest.raises(RuntimeError, match="outside the token table"):
        cpu_attention.decode_attention(q, k_cache, v_cache, table, torch.tensor([0, table.shape[0]]), seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="one layout"):
        cpu_attention.decode_attention(q, k_cache[:, :0], v_cache[:, :0], table, rows, seq_lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_the_cache_reaches_the_output(dtype: torch.dtype) -> None:
    """A NaN key makes its request's output NaN (as SDPA does), not silently dropped."""
    q, k_cache, v_cache, table, rows, seq_lens = _paged_case(dtype, [20, 30])
    k_cache[table[rows[1], 3].long()] = float("nan")
    out = cpu_attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.125)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
