"""`--kv-cache-dtype`'s float choices (kvcache/pool.py resolve_kv_dtype): what "auto" means where,
which combinations are refused with a clear error, the 16-bit store's rounding (nearest even),
and the torch backend's choice of the C++ decode kernel over 16-bit pages."""

from __future__ import annotations

import pytest
import torch

from minisgl.kvcache.pool import KVPool, resolve_kv_dtype

F16, BF16, F32, FP8 = torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn


def test_auto_is_fp16_for_gguf_blocks_on_the_torch_backend_only() -> None:
    assert resolve_kv_dtype("auto", F32, True, "torch", False) == F16  # the quantized CPU default
    assert resolve_kv_dtype("auto", F32, False, "torch", False) == F32  # --weights float32: the exact mode
    assert resolve_kv_dtype("auto", BF16, False, "torch", False) == BF16
    assert resolve_kv_dtype("auto", F32, True, "triton", False) == F32  # the interpreted Triton kernels
    assert resolve_kv_dtype("auto", F32, True, "torch", True) == F32  # an MLA latent cache
    assert resolve_kv_dtype("auto", BF16, False, "triton", False) == BF16  # GPU: unchanged


def test_auto_takes_the_half_type_it_is_given() -> None:
    """The engine passes bf16 where the CPU kernels run their portable path (scalar fp16 conversion)."""
    assert resolve_kv_dtype("auto", F32, True, "torch", False, half=BF16) == BF16
    assert resolve_kv_dtype("auto", F32, False, "torch", False, half=BF16) == F32  # the exact mode keeps fp32
    assert resolve_kv_dtype("float16", F32, True, "torch", False, half=BF16) == F16  # an explicit choice wins


def test_explicit_choices() -> None:
    assert resolve_kv_dtype("float32", F32, True, "torch", False) == F32  # opting out of fp16 pages
    assert resolve_kv_dtype("bfloat16", F32, True, "torch", False) == BF16
    assert resolve_kv_dtype("float16", BF16, False, "torch", False) == F16
    assert resolve_kv_dtype("bfloat16", BF16, False, "triton", False) == BF16  # = the model dtype: any backend
    assert resolve_kv_dtype("fp8_e4m3", BF16, False, "triton", False) == FP8
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 under a bfloat16 model needs --attn torch"):
        resolve_kv_dtype("float16", BF16, False, "triton", False)
    with pytest.raises(ValueError, match="MLA model's latent cache"):
        resolve_kv_dtype("float16", F32, False, "torch", True)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_store_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    pool = KVPool(1, 2, 16, 1, 4, dtype, torch.device("cpu"), compute_dtype=F32)
    assert pool.k[0].dtype == dtype and not pool.quantized
    ulp = 2.0 ** (-10 if dtype == F16 else -7)  # at 1.0
    # Ties: 1 + ulp/2 -> 1 (even), 1 + 3 ulp/2 -> 1 + 2 ulp (even); off-ties to the nearer.
    k = torch.tensor([[[1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp * 0.49, 1 + ulp * 0.51]]], dtype=F32)
    pool.store(0, torch.tensor([5]), k, -k)
    assert pool.k[0][5, 0].float().tolist() == [1.0, 1 + 2 * ulp, 1.0, 1 + ulp]
    assert pool.v[0][5, 0].float().tolist() == [-1.0, -1 - 2 * ulp, -1.0, -1 - ulp]


def test_16bit_pool_is_half_the_bytes() -> None:
    args = (30, 16, 3, 64)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert KVPool.bytes_per_page(*args, F16) * 2 == KVPool.bytes_per_page(*args, F32) == 16 * 46080


def test_backend_decodes_16bit_pages_with_the_kernel_under_fp32_kernels() -> None:
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.kernels import cpu_attention
    from minisgl.platform import current
    from minisgl.platform.kernel_config import KernelConfig

    if cpu_attention.load() is None:
        pytest.skip("the C++ kernel could not be built here")
    platform = current()
    try:
        for fp32_kernels in (False, True):
            platform.use_kernels(KernelConfig(cpu_kernels_fp32=fp32_kernels))
            for dtype in (F16, BF16, F32):
                pool = KVPool(2, 8, 16, 3, 64, dtype, torch.device("cpu"), compute_dtype=F32)
                assert TorchAttnBackend(pool, 9, 3, 64, 0.125).cpu_kernel is fp32_kernels, (dtype, fp32_kernels)
            fp8 = KVPool(2, 8, 16, 3, 64, FP8, torch.device("cpu"), compute_dtype=F32)
            assert not TorchAttnBackend(fp8, 9, 3, 64, 0.125).cpu_kernel  # float8 keeps the torch path
    finally:
        platform.use_kernels(KernelConfig())
