"""The float C++ CPU kernels (RMSNorm, rotary, SiLU-and-mul, GEMV / small GEMM, paged decode
attention): one shared library built on first use with the system compiler and called through
ctypes (the GIL is released during a call). `kernels/cpu_ops.py` and `kernels/cpu_attention.py`
are the layers' entry points; this module builds, loads and binds the library.

Code paths, picked at run time by the CPU (`set_isa`, or `isa=` per call, forces one):
"avx512" (F/BW/VL/DQ; with AVX512-BF16, bf16 GEMV/GEMM and decode attention use `vdpbf16ps`),
"avx2" (+FMA: bf16 loaded and stored by 16-bit shifts, fp32 math) and "portable" (plain C++,
any target). fp32 and bf16 on every path. Each ISA's translation unit (kernels/csrc/cpu_*.cpp)
carries its own target attributes, never -march=native, so one build runs on AVX2-only and
AVX-512 CPUs alike; `load_library(portable_only=True)` builds the portable path alone with no
x86 code (what a non-x86 target gets; the tests build and check it).

No torch headers are compiled (the kernels take raw pointers), so the cold build takes seconds,
not the minute a torch extension takes; it is cached under `build_dir()` and logged once.
Shape and dtype errors raise RuntimeError, as the checks of a torch extension do.
"""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Literal

import torch

from minisgl.env import ENV
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

Isa = Literal["avx512", "avx2", "portable"]
IsaChoice = Isa | Literal["auto"]
ISAS: tuple[Isa, ...] = ("portable", "avx2", "avx512")  # index = the C++ ISA id
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("cpu_dispatch.cpp", "cpu_portable.cpp", "cpu_avx2.cpp", "cpu_avx512.cpp", "cpu_avx512bf16.cpp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {2: "ISA not compiled in or not supported by this CPU", 4: "out of memory",
           5: "position out of the table", 6: "row or length outside the token table"}  # fmt: skip
_I64, _PTR, _INT, _DBL = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "minisgl_cpu_rms_norm": [_INT, _INT, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _DBL, _INT],
    "minisgl_cpu_rotary": [_INT, _INT, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR,
                           _I64, _PTR, _PTR, _DBL, _DBL, _PTR, _PTR, _INT],
    "minisgl_cpu_silu_and_mul": [_INT, _INT, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "minisgl_cpu_linear": [_INT, _INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "minisgl_cpu_decode_attention": [_INT, _INT, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64,
                                     _PTR, _PTR, _I64, _I64, _I64, _I64, _DBL, _PTR, _I64, _I64, _INT],
}  # fmt: skip


def _dtype(what: str, *tensors: torch.Tensor) -> int:
    """The C++ dtype id of tensors that must be CPU tensors of one dtype, fp32 or bf16."""
    first = tensors[0]
    dt = _DTYPES.get(first.dtype)
    if dt is None or any(t.dtype != first.dtype or t.device.type != "cpu" for t in tensors) or first.device.type != "cpu":
        raise RuntimeError(f"{what}: bf16 or fp32 CPU tensors of one dtype expected")
    return dt


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


class CpuKernels:
    """One build of the library. Each method has its op's signature plus `isa` (None: the
    module's `set_isa` choice) and returns new tensors."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
        self._lib = lib
        compiled, cpu = lib.minisgl_cpu_isas_compiled(), lib.minisgl_cpu_isas_cpu()
        self.compiled: tuple[Isa, ...] = tuple(n for i, n in enumerate(ISAS) if compiled >> i & 1)
        self.supported: tuple[Isa, ...] = tuple(n for i, n in enumerate(ISAS) if (compiled & cpu) >> i & 1)
        self._bf16_dot = bool(lib.minisgl_cpu_has_bf16_dot())
        self._default: int | None = None  # the resolved `set_isa` choice, cached per generation
        self._generation = -1

    def best_isa(self) -> Isa:
        return self.supported[-1]

    def isa_id(self, isa: IsaChoice | None = None) -> int:
        """The C++ id of the path a call with this `isa` takes; ValueError if it cannot run here."""
        if isa is None:
            if self._generation != _CHOICE.generation:
                self._default, self._generation = self.isa_id(_CHOICE.isa), _CHOICE.generation
            assert self._default is not None
            return self._default
        name = self.best_isa() if isa == "auto" else isa
        if name not in self.supported:
            raise ValueError(f"ISA {name!r} unavailable here (this build and CPU run: {', '.join(self.supported)})")
        return ISAS.index(name)

    def resolve(self, isa: IsaChoice | None = None) -> Isa:
        return ISAS[self.isa_id(isa)]

    def has_bf16_dot(self, isa: IsaChoice | None = None) -> bool:
        """Whether bf16 GEMV / GEMM and decode attention take AVX512-BF16 dot products on `isa`."""
        return self._bf16_dot and self.isa_id(isa) == ISAS.index("avx512")

    # ---------------------------------------------------------------- norms
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, isa: IsaChoice | None = None) -> torch.Tensor:
        """x [..., H] (rows may be strided, unit stride along H), w [H] -> [..., H]."""
        dt = _dtype("rms_norm", x, w)
        H = x.shape[-1] if x.dim() else 0
        if H == 0 or w.numel() != H or not w.is_contiguous() or x.stride(-1) != 1:
            raise RuntimeError("rms_norm: shapes")
        rows = x if x.dim() == 2 else x.reshape(-1, H)
        out = torch.empty(rows.shape, dtype=x.dtype)
        rc = self._lib.minisgl_cpu_rms_norm(self.isa_id(isa), dt, rows.data_ptr(), rows.stride(0), None, None,
                                            w.data_ptr(), out.data_ptr(), rows.shape[0], H, eps,
                                            torch.get_num_threads())  # fmt: skip
        _check(rc, "rms_norm")
        return out if x.dim() == 2 else out.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                     isa: IsaChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(rms_norm(x + residual), x + residual) as new tensors; x, residual [..., H] contiguous."""
        dt = _dtype("add_rms_norm", x, residual, w)
        H = x.shape[-1] if x.dim() else 0
        if (H == 0 or x.shape != residual.shape or not x.is_contiguous() or not residual.is_contiguous()
                or w.numel() != H or not w.is_contiguous()):  # fmt: skip
            raise RuntimeError("add_rms_norm: shapes")
        out, total = torch.empty_like(x), torch.empty_like(x)
        rc = self._lib.minisgl_cpu_rms_norm(self.isa_id(isa), dt, x.data_ptr(), H, residual.data_ptr(),
                                            total.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // H, H, eps,
                                            torch.get_num_threads())  # fmt: skip
        _check(rc, "add_rms_norm")
        return out, total

    # ---------------------------------------------------------------- rotary
    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               q_eps: float = 0.0, k_eps: float = 0.0,
               isa: IsaChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """q [T, Hq, D], k [T, Hk, D] (any token/head strides, unit stride on D), positions [T]
        int64, cos/sin fp32 [P, D/2]; with q/k norm weights [D] (Qwen3) a per-head RMSNorm first."""
        dt = _dtype("rotary", q, k)
        if q.dim() != 3 or k.dim() != 3 or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
            raise RuntimeError("rotary: q [T, Hq, D], k [T, Hk, D]")
        if q.stride(2) != 1 or k.stride(2) != 1:
            raise RuntimeError("rotary: unit stride along D")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            raise RuntimeError("rotary: fp32 tables")
        T, Hq, D = q.shape
        if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.numel() != T:
            raise RuntimeError("rotary: int64 positions [T]")
        if D % 2 or cos.dim() != 2 or cos.shape[1] != D // 2 or sin.shape != cos.shape:
            raise RuntimeError("rotary: even D, tables [P, D/2]")
        if cos.device.type != "cpu" or sin.device.type != "cpu" or positions.device.type != "cpu":
            raise RuntimeError("rotary: CPU tensors")
        qw = kw = None
        if q_weight is not None:
            if k_weight is None:
                raise RuntimeError("rotary: q and k norm weights together")
            _dtype("rotary norm weights", q, q_weight, k_weight)
            if q_weight.numel() != D or k_weight.numel() != D or not q_weight.is_contiguous() or not k_weight.is_contiguous():
                raise RuntimeError("rotary: per-head norm weights [D]")
            qw, kw = q_weight.data_ptr(), k_weight.data_ptr()
        Hk = k.shape[1]
        qo, ko = torch.empty(T, Hq, D, dtype=q.dtype), torch.empty(T, Hk, D, dtype=k.dtype)
        rc = self._lib.minisgl_cpu_rotary(self.isa_id(isa), dt, positions.data_ptr(), q.data_ptr(), q.stride(0),
                                          q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), T, Hq, Hk, D,
                                          cos.data_ptr(), sin.data_ptr(), cos.shape[0], qw, kw, q_eps, k_eps,
                                          qo.data_ptr(), ko.data_ptr(), torch.get_num_threads())  # fmt: skip
        _check(rc, "rotary")
        return qo, ko

    # ---------------------------------------------------------------- SiLU and mul
    def silu_and_mul(self, x: torch.Tensor, isa: IsaChoice | None = None) -> torch.Tensor:
        """x [..., 2I] = [gate | up] (unit stride) -> silu(gate) * up [..., I]."""
        dt = _dtype("silu_and_mul", x)
        if x.dim() == 0 or x.stride(-1) != 1 or x.shape[-1] % 2:
            raise RuntimeError("silu_and_mul: [.., 2I], unit stride")
        inner = x.shape[-1] // 2
        rows = x if x.dim() == 2 else x.reshape(-1, 2 * inner)
        out = torch.empty(rows.shape[0], inner, dtype=x.dtype)
        rc = self._lib.minisgl_cpu_silu_and_mul(self.isa_id(isa), dt, rows.data_ptr(), rows.stride(0), rows.shape[0],
                                                inner, out.data_ptr(), torch.get_num_threads())  # fmt: skip
        _check(rc, "silu_and_mul")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], inner)

    # ---------------------------------------------------------------- GEMV / small GEMM
    def gemm_rows(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N]: fp32 dot products, one rounding to x's dtype
        (with a bias: F.linear's out + bias). Register-tiled over a few rows; any K."""
        dt = _dtype("gemm", x, w) if bias is None else _dtype("gemm", x, w, bias)
        if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise RuntimeError("gemm: x [M, K], w [N, K]")
        if x.stride(1) != 1 or w.stride(1) != 1:
            raise RuntimeError("gemm: unit stride along K")
        M, K = x.shape
        N = w.shape[0]
        if bias is not None and (bias.numel() != N or not bias.is_contiguous()):
            raise RuntimeError("gemm bias: [N] expected")
        out = torch.empty(M, N, dtype=x.dtype)
        rc = self._lib.minisgl_cpu_linear(self.isa_id(isa), dt, x.data_ptr(), x.stride(0), M, w.data_ptr(),
                                          w.stride(0), N, K, None if bias is None else bias.data_ptr(),
                                          out.data_ptr(), torch.get_num_threads())  # fmt: skip
        _check(rc, "gemm")
        return out

    def gemv(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """x [1, K] @ w [N, K]^T (+ bias) -> [1, N]."""
        if x.dim() != 2 or x.shape[0] != 1:
            raise RuntimeError("gemv: x [1, K], w [N, K]")
        return self.gemm_rows(x, w, bias, isa)

    # ---------------------------------------------------------------- decode attention
    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """q [B, Hq, D]; pools [S, Hkv, D]; table [R, C] int32 slots; rows [B] int64; seq_lens [B]
        int32 -> [B, Hq, D]: each request's query against its first seq_len table entries."""
        dt = _dtype("decode attention", q, k_cache, v_cache)
        if q.dim() != 3 or k_cache.dim() != 3 or q.shape[2] != k_cache.shape[2]:
            raise RuntimeError("decode attention: q [B, Hq, D], pools [S, Hkv, D]")
        if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
            raise RuntimeError("decode attention: unit stride along D")
        B, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        if Hkv == 0 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or Hq % Hkv:
            raise RuntimeError("decode attention: K/V pools of one layout, Hq % Hkv == 0")
        if Hq // Hkv > 64:
            raise RuntimeError("decode attention: at most 64 query heads per KV head")
        if table.device.type != "cpu" or rows.device.type != "cpu" or seq_lens.device.type != "cpu":
            raise RuntimeError("decode attention: CPU tensors")
        if table.dim() != 2 or rows.numel() < B or seq_lens.numel() < B:
            raise RuntimeError("decode attention: one row and length per query")
        if table.dtype != torch.int32 or rows.dtype != torch.int64 or seq_lens.dtype != torch.int32:
            raise RuntimeError("decode attention: int32 table, int64 rows, int32 seq_lens")
        if table.stride(1) != 1 or not rows.is_contiguous() or not seq_lens.is_contiguous():
            raise RuntimeError("decode attention: unit-stride table rows, contiguous rows and seq_lens")
        out = torch.empty(B, Hq, D, dtype=q.dtype)
        rc = self._lib.minisgl_cpu_decode_attention(
            self.isa_id(isa), dt, q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.stride(0), k_cache.stride(1), table.data_ptr(), table.stride(0), table.shape[0], table.shape[1],
            rows.data_ptr(), seq_lens.data_ptr(), B, Hq, Hkv, D, scale, out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "decode attention")
        return out


class _IsaChoice:
    """The `set_isa` choice; `generation` tells the loaded libraries to re-resolve it."""

    def __init__(self) -> None:
        self.isa: IsaChoice = "auto"
        self.generation = 0


_CHOICE = _IsaChoice()
_LIBS: dict[bool, CpuKernels] = {}
_FAILED: dict[bool, str] = {}
_LOCK = threading.Lock()


def set_isa(isa: IsaChoice) -> None:
    """Force one code path for the calls that pass no `isa` ("auto": the best the CPU has).
    Checked against the CPU on the next call (ValueError there if it cannot run)."""
    if isa != "auto" and isa not in ISAS:
        raise ValueError(f"isa must be one of auto, {', '.join(ISAS)}; got {isa!r}")
    _CHOICE.isa, _CHOICE.generation = isa, _CHOICE.generation + 1


def build_dir(portable_only: bool = False) -> Path:
    return ENV.cache_dir / "cpu_kernels" / ("portable" if portable_only else "all")


def load_library(portable_only: bool = False) -> CpuKernels:
    """The built kernels (built on first use, then cached under `build_dir()`); RuntimeError if the
    build fails. `portable_only`: the portable path alone, compiled with no x86 code or flags."""
    with _LOCK:
        if portable_only in _LIBS:
            return _LIBS[portable_only]
        if portable_only in _FAILED:
            raise RuntimeError(_FAILED[portable_only])
        from torch.utils.cpp_extension import load

        name = "minisgl_cpu_kernels_portable" if portable_only else "minisgl_cpu_kernels"
        sources = _SOURCES[:2] if portable_only else _SOURCES
        directory = build_dir(portable_only)
        directory.mkdir(parents=True, exist_ok=True)
        cached = any(directory.glob(f"{name}*.so"))
        if not cached:
            logger.info("building the C++ CPU kernels, once (%s; ~10 s on 2 cores) in %s",
                        "portable only" if portable_only else "avx512 + avx2 + portable", directory)  # fmt: skip
        cflags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-maybe-uninitialized",
                  "-Wno-uninitialized"]  # fmt: skip
        if portable_only:
            cflags.append("-DCPU_PORTABLE_ONLY")
        start = time.perf_counter()
        try:
            path = load(name=name, sources=[str(_CSRC / s) for s in sources], extra_cflags=cflags,
                        extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)],
                        build_directory=str(directory), is_python_module=False, verbose=False)  # fmt: skip
        except Exception as exc:  # no compiler: the callers keep their torch paths
            _FAILED[portable_only] = f"building the C++ CPU kernels failed ({type(exc).__name__}: {exc})"
            raise RuntimeError(_FAILED[portable_only]) from exc
        lib = _LIBS[portable_only] = CpuKernels(str(path))
        (logger.debug if cached else logger.info)("C++ CPU kernels %s in %.1f s (paths: %s; best %s)",
                                                  "loaded" if cached else "built", time.perf_counter() - start,
                                                  ", ".join(lib.supported), lib.best_isa())  # fmt: skip
        return lib


_WARNED: set[str] = set()


def load_or_warn(flag: str, what: str) -> CpuKernels | None:
    """The library, or None after one warning naming why and `flag`, the switch that hides it."""
    try:
        return _LIBS.get(False) or load_library()
    except RuntimeError as exc:
        if flag not in _WARNED:
            _WARNED.add(flag)
            logger.warning("%s unavailable (%s); using the torch path (%s hides this)", what, exc, flag)
        return None
