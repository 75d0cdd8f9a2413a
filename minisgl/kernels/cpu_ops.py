"""bf16 CPU kernels for the per-token work of a decoder layer: GEMV, RMSNorm (with the residual
add), rotary (with Qwen3's q/k norms), SiLU-and-mul. One small C++ extension built at engine start.

Why: decoding one request on CPU reads every weight once per token, so the weights' bytes set the
floor (~10 ms for SmolLM2 in bf16 on the 2-core CI machine), but the plain-torch layer code adds
~60 small aten ops per layer (casts, pow/mean/rsqrt, chunk/cat/neg for rotary, ...), ~15 ms more
per token, and each torch.compile'd region adds ~50 us of wrapper. Here each op is one C++ call
(a few us), with fp32 math and the reference's bf16 rounding points:

- RMSNorm: Hugging Face's order (fp32 normalise, round to bf16, times the bf16 weight, round);
  `add_rms_norm` first rounds x + residual to bf16, as the torch reference does.
- rotary: cos/sin rounded to bf16, each product rounded, the sum rounded (the reference's
  eager bf16 ops), neox halves.
- SiLU-and-mul: silu(gate) rounded to bf16, times up, rounded.
- GEMV (one row) and small GEMM (up to `SMALL_GEMM_ROWS` rows, register tiles of 4 weight rows x
  6 input rows): fp32 dot products (AVX-512 BF16 `vdpbf16ps` where the CPU has it), rounded once.
- exp for SiLU and the CPU decode attention's softmax: a vectorised 2^n * 2^f with a degree-6
  series (~1e-7 relative), in kernels/csrc/avx512_math.h.

The references (`kernels/*_ref.py`) are the oracles (tests/unit/test_cpu_ops.py). Only bf16 takes
this path; fp32 stays on the references, the exact-parity mode. Off: --no-cpu-kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from minisgl.kernels.activation_ref import silu_and_mul_ref
from minisgl.kernels.cpp_ext import CppExtension
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref
from minisgl.platform import current

# The C++ sources: kernels/csrc/avx512_math.h (vector math shared with `cpu_attention`, compiled
# only where the CPU has AVX-512 BF16, `-march=native`) and kernels/csrc/cpu_ops.cpp.
_EXT = CppExtension(
    "minisgl_cpu_ops", ("avx512_math.h", "cpu_ops.cpp"),
    ["gemv", "gemm_rows", "has_bf16_dot", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul"],
    flag="--no-cpu-kernels", what="bf16 CPU kernels",
)  # fmt: skip


def load() -> Any:
    """The built extension, or None (turned off by --no-cpu-kernels, or the build failed: then
    the callers keep the references)."""
    return _EXT.load() if current().kernels.cpu_kernels else None


def enabled() -> bool:
    """Whether the extension is (or can be) loaded; builds it on first call."""
    return load() is not None


def _ready(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _EXT.module is not None


# Thin wrappers with the references' signatures: bf16 CPU tensors take the C++ kernel, anything
# else (fp32, the exact mode) the reference.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _ready(x) and weight.dtype == torch.bfloat16 and x.stride(-1) == 1:
        return _EXT.module.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        _ready(x) and residual.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
        and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous() and x.shape == residual.shape
    ):  # fmt: skip
        return _EXT.module.add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _rotary_ok(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """What the C++ rotary takes: bf16 [T, H, D] views with unit stride on an even D, fp32 tables."""
    return (
        _ready(q) and k.dtype == torch.bfloat16 and q.dim() == k.dim() == 3 and q.shape[-1] % 2 == 0
        and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64
        and cos.dtype == sin.dtype == torch.float32
    )  # fmt: skip


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _rotary_ok(positions, q, k, cos, sin):
        return _EXT.module.rotary(positions.contiguous(), q, k, cos, sin, None, None, 0.0, 0.0)
    return rotary_ref(positions, q, k, cos, sin)


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if _rotary_ok(positions, q, k, cos, sin) and q_weight.dtype == k_weight.dtype == torch.bfloat16:
        return _EXT.module.rotary(positions.contiguous(), q, k, cos, sin, q_weight, k_weight, q_eps, k_eps)
    return qk_norm_rotary_ref(positions, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _ready(x):
        return _EXT.module.silu_and_mul(x)
    return silu_and_mul_ref(x)


# Up to this many rows the register-tiled C++ GEMM beats oneDNN's bf16 GEMM on the CI machine
# (SmolLM2's layer shapes: 2.2-3x at 2-8 rows, 1.2x at 16, even at 32); beyond, oneDNN.
SMALL_GEMM_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; bf16 with one row goes through the C++ GEMV, with a few rows through the
    C++ small GEMM (needs AVX-512 BF16 and K % 32 == 0); more rows keep oneDNN's GEMM."""
    if (
        _ready(x) and x.dim() == 2 and x.shape[0] <= SMALL_GEMM_ROWS and weight.dtype == torch.bfloat16
        and x.stride(1) == 1 and weight.stride(1) == 1
    ):  # fmt: skip
        if x.shape[0] == 1:
            return _EXT.module.gemv(x, weight, bias)
        if x.shape[1] % 32 == 0 and _EXT.module.has_bf16_dot():
            return _EXT.module.gemm_rows(x, weight, bias)
    return F.linear(x, weight, bias)
