"""Paged decode attention on CPU in one call per layer: a small C++ kernel built at first use.

The torch path attends request by request (gather the request's K and V out of the pool, one
SDPA call): at 32 requests that is ~1,900 gathers and 960 SDPA calls per step for SmolLM2, over
half of a bf16 decode step on 2 cores. This kernel reads K and V straight from the pool through
the token table, one task per (request, KV head) across the CPU's threads, with a two-pass softmax
in fp32. Used for bf16 only (the fast mode); fp32 keeps the torch path, the exact-parity mode.

Built with `torch.utils.cpp_extension.load_inline` (a C++ compiler, ~1 min once, cached under
~/.cache/torch_extensions). If the build fails the backend logs why and keeps the torch path.
Off: --no-cpu-attn-kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from minisgl.kernels.cpp_ext import CppExtension
from minisgl.platform import current

# The C++ source: kernels/csrc/avx512_math.h (shared with `cpu_ops`) and
# kernels/csrc/cpu_decode_attention.cpp.
_EXT = CppExtension(
    "minisgl_cpu_decode_attention", ("avx512_math.h", "cpu_decode_attention.cpp"), ["decode_attention"],
    flag="--no-cpu-attn-kernel", what="CPU decode attention kernel",
    cflags=("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only"),
)  # fmt: skip


def load() -> Any:
    """The built extension, or None (build failed, or turned off by --no-cpu-attn-kernel)."""
    return _EXT.load() if current().kernels.cpu_attn_kernel else None


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D]; pools [S, Hkv, D]; table [R, C] int32 slots; rows [B] int64; seq_lens [B]
    int32 -> [B, Hq, D]: each request's query against its first seq_len table entries."""
    module = load()
    assert module is not None, "call load() first and check it"
    return module.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, scale)
