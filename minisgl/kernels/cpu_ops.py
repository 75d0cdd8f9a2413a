"""C++ CPU kernels for the per-token work of a decoder layer: GEMV, RMSNorm (with the residual
add), rotary (with Qwen3's q/k norms), SiLU-and-mul. The library (kernels/cpp_ext.py, sources in
kernels/csrc/cpu_*.cpp) is built once and picks its code path by the CPU: AVX-512 (AVX512-BF16
dot products for bf16 where the CPU has them), AVX2+FMA, or portable C++; `set_isa` forces one.

Why: decoding one request on CPU reads every weight once per token, so the weights' bytes set the
floor (~10 ms for SmolLM2 in bf16 on the 2-core CI machine), but the plain-torch layer code adds
~60 small aten ops per layer (casts, pow/mean/rsqrt, chunk/cat/neg for rotary, ...), ~15 ms more
per token, and each torch.compile'd region adds ~50 us of wrapper. Here each op is one C++ call
(a few us), with fp32 math and the reference's rounding points:

- RMSNorm: Hugging Face's order (fp32 normalise, round to bf16, times the bf16 weight, round);
  `add_rms_norm` first rounds x + residual to bf16, as the torch reference does.
- rotary: cos/sin rounded to bf16, each product rounded, the sum rounded (the reference's
  eager bf16 ops), neox halves.
- SiLU-and-mul: silu(gate) rounded to bf16, times up, rounded.
- GEMV (one row) and small GEMM (up to `SMALL_GEMM_ROWS` rows, register tiles of 4 weight rows x
  6 input rows): fp32 dot products (AVX-512 BF16 `vdpbf16ps` where the CPU has it), rounded once.
- exp for SiLU and the CPU decode attention's softmax: a vectorised 2^n * 2^f with a degree-6
  series (~1e-7 relative).

The references (`kernels/*_ref.py`) are the oracles (tests/unit/test_cpu_ops.py). bf16 takes this
path; fp32 stays on the references (the exact-parity mode: the kernels' fp32 sums are in another
order) unless `set_fp32(True)` sends fp32 norms, rotary and SiLU here too: the engine does so with
`KernelConfig.cpu_kernels_fp32`, on by default for GGUF weights kept quantized (linear there is the
quantized GEMV/GEMM, kernels/cpu_quant.py). Off: --no-cpu-kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.activation_ref import silu_and_mul_ref
from minisgl.kernels.cpp_ext import CpuKernels, IsaChoice, load_or_warn
from minisgl.kernels.cpp_ext import set_isa as _set_isa
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref
from minisgl.platform import current

__all__ = ["SMALL_GEMM_ROWS", "enabled", "fused_add_rms_norm", "linear", "load", "qk_norm_rotary", "rms_norm",
           "rotary", "set_fp32", "set_isa", "silu_and_mul", "takes"]  # fmt: skip


class _State:
    """The loaded library (None until `load`) and the dtypes the wrappers send to it."""

    def __init__(self) -> None:
        self.lib: CpuKernels | None = None
        self.dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)


_STATE = _State()


def load() -> CpuKernels | None:
    """The built library, or None (turned off by --no-cpu-kernels, or the build failed: then the
    callers keep the references)."""
    if not current().kernels.cpu_kernels:
        return None
    if _STATE.lib is None:
        _STATE.lib = load_or_warn("--no-cpu-kernels", "C++ CPU kernels")
    return _STATE.lib


def enabled() -> bool:
    """Whether the library is (or can be) loaded; builds it on first call."""
    return load() is not None


def set_isa(isa: IsaChoice) -> None:
    """Force the code path of every C++ CPU kernel ("auto": the best the CPU runs)."""
    _set_isa(isa)


def set_fp32(on: bool) -> None:
    """Whether fp32 norms, rotary and SiLU take the C++ kernels (default off: the references)."""
    _STATE.dtypes = (torch.bfloat16, torch.float32) if on else (torch.bfloat16,)


def takes(dtype: torch.dtype) -> bool:
    """Whether the wrappers send CPU tensors of `dtype` to the loaded library."""
    return dtype in _STATE.dtypes and _STATE.lib is not None


def _ready(x: torch.Tensor) -> bool:
    return x.dtype in _STATE.dtypes and x.is_cpu and _STATE.lib is not None


# Thin wrappers with the references' signatures: bf16 CPU tensors (and fp32 after set_fp32) take
# the C++ kernel, anything else the reference.


# The wrappers call the binding's functions (`lib.module`) directly: one Python frame less per call
# (the layers make ~10 of these calls per layer and token).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _STATE.lib
    if lib is not None and x.dtype in _STATE.dtypes and x.is_cpu and weight.dtype == x.dtype and x.stride(-1) == 1:
        return lib.module.rms_norm(x, weight, eps, lib.isa_id())
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        _ready(x) and residual.dtype == x.dtype and weight.dtype == x.dtype
        and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous() and x.shape == residual.shape
    ):  # fmt: skip
        lib = _STATE.lib
        return lib.module.add_rms_norm(x, residual, weight, eps, lib.isa_id())  # type: ignore[union-attr]
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _rotary_ok(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """What the C++ rotary takes: [T, H, D] views with unit stride on an even D, fp32 tables."""
    return (
        _ready(q) and k.dtype == q.dtype and q.dim() == k.dim() == 3 and q.shape[-1] % 2 == 0
        and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64
        and cos.dtype == sin.dtype == torch.float32
    )  # fmt: skip


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _rotary_ok(positions, q, k, cos, sin):
        lib = _STATE.lib
        return lib.module.rotary(positions.contiguous(), q, k, cos, sin, None, None, 0.0, 0.0, lib.isa_id())  # type: ignore[union-attr]
    return rotary_ref(positions, q, k, cos, sin)


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if _rotary_ok(positions, q, k, cos, sin) and q_weight.dtype == k_weight.dtype == q.dtype:
        lib = _STATE.lib
        return lib.module.rotary(positions.contiguous(), q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, lib.isa_id())  # type: ignore[union-attr]
    return qk_norm_rotary_ref(positions, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = _STATE.lib
    if lib is not None and x.dtype in _STATE.dtypes and x.is_cpu and x.stride(-1) == 1:
        return lib.module.silu_and_mul(x, lib.isa_id())
    return silu_and_mul_ref(x)


# Up to this many rows the register-tiled C++ GEMM with AVX512-BF16 dot products beats oneDNN's
# bf16 GEMM on the CI machine (SmolLM2's layer shapes: 2.2-3x at 2-8 rows, 1.2x at 16, even at
# 32); beyond, and on CPUs without them, oneDNN.
SMALL_GEMM_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; bf16 with one row goes through the C++ GEMV, with a few rows through the
    C++ small GEMM (where the CPU has AVX512-BF16, K % 32 == 0); more rows keep oneDNN's GEMM."""
    lib = _STATE.lib
    if (
        lib is not None and x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2
        and x.shape[0] <= SMALL_GEMM_ROWS and weight.dtype == torch.bfloat16
        and x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.dtype == torch.bfloat16)
    ):  # fmt: skip
        if x.shape[0] == 1 or (x.shape[1] % 32 == 0 and lib.has_bf16_dot()):
            return lib.module.linear(x, weight, bias, lib.isa_id())
    return F.linear(x, weight, bias)
