"""Paged decode attention on CPU in one call per layer: a C++ kernel of the CPU kernel library
(kernels/cpp_ext.py: AVX-512 with AVX512-BF16 dot products for bf16, AVX-512, AVX2+FMA or
portable C++, picked by the CPU; `cpp_ext.set_isa` forces one), built once at first use.

The torch path attends request by request (gather the request's K and V out of the pool, one
SDPA call): at 32 requests that is ~1,900 gathers and 960 SDPA calls per step for SmolLM2, over
half of a bf16 decode step on 2 cores. This kernel reads K and V straight from the pool through
the token table, one task per (request, KV head) across the CPU's threads, with a two-pass softmax
in fp32. q (and the output) is bf16 or fp32; the pages fp32, bf16 or fp16 (16-bit rows are
converted to fp32 as they are read: a shift for bf16, F16C / AVX-512 vcvtph2ps or an exact scalar
conversion for fp16), so the math is fp32 over narrower pages. The attention backend uses it for a
bf16 model (the fast mode) and for fp32 activations where the kernel config allows it
(cpu_kernels_fp32: GGUF weights kept quantized); a float fp32 model keeps the torch path, the
exact-parity mode (tests/unit/test_cpu_attention.py, tests/kernels/test_cpu_attention_kv16.py).

If the build fails the backend logs why and keeps the torch path. Off: --no-cpu-attn-kernel.
"""

from __future__ import annotations

import torch

from minisgl.kernels.cpp_ext import CpuKernels, IsaChoice, load_or_warn
from minisgl.platform import current


def load() -> CpuKernels | None:
    """The built library, or None (build failed, or turned off by --no-cpu-attn-kernel)."""
    if not current().kernels.cpu_attn_kernel:
        return None
    return load_or_warn("--no-cpu-attn-kernel", "CPU decode attention kernel")


PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pool_dtypes() -> tuple[torch.dtype, ...]:
    """The activation (q) dtypes the backend hands this kernel under the current kernel config."""
    kernels = current().kernels
    if not kernels.cpu_attn_kernel:
        return ()
    return (torch.bfloat16, torch.float32) if kernels.cpu_kernels_fp32 else (torch.bfloat16,)


def takes(page_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether the backend decodes pages of `page_dtype` under `compute_dtype` activations here."""
    return page_dtype in PAGE_DTYPES and compute_dtype in pool_dtypes()


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    isa: IsaChoice | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (fp32 or bf16); pools [S, Hkv, D] (fp32, bf16 or fp16); table [R, C] int32
    slots; rows [B] int64; seq_lens [B] int32 -> [B, Hq, D] in q's dtype: each request's query
    against its first seq_len table entries."""
    module = load()
    assert module is not None, "call load() first and check it"
    return module.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, scale, isa)
