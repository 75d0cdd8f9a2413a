"""Weight-only quantized CPU matmuls over GGUF blocks: y = x @ W^T with W kept as its GGUF blocks
(Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; `tensor.data` of a gguf.GGUFReader tensor, [N, row_bytes] uint8)
and x fp32. The activations are never quantized: each kernel dequantizes the weights in registers
with the reference's float operations (quant_ref.py) and accumulates x * w in fp32, so the output
is the dequantize-then-fp32-matmul result up to summation order.

`QuantMatrix.create(blocks, qtype)` validates a tensor once; `quant_linear(x, qm)` is the lean
per-call path for a layer (GEMV up to GEMV_MAX_ROWS rows, GEMM beyond). Two kernels, both split over output rows across `torch.get_num_threads()` OpenMP threads:
- GEMV (`quant_gemv`, up to GEMV_MAX_ROWS = 12 activation rows: decode): a few weight rows x up to 4 activation
  rows per register tile; each weight byte is read from memory once per call. Q4_0/Q4_1/Q8_0 on
  AVX2 and AVX-512 take the "lanes" tiles (csrc/quant_gemv_lanes.h: nibbles masked in place from a
  broadcast load, x permuted to match once per call, the scales factored out of each block's sum:
  the reference's products, summed in another order).
- GEMM (`quant_gemm`, prefill and batched decode): x packed once per call into blocks of 2 vectors
  of rows (k-major, shared by the threads), 48 weight rows at a time dequantized into an fp32
  panel laid out in 64-k chunks, then an outer-product register tile (2 x-vectors x 6 broadcast
  weights on AVX2, x 12 on AVX-512) over one L1-sized k-chunk at a time: no horizontal sums, each
  load feeds 1.5-2.4 FMAs, the chunk's sums added to an output tile written out row by row.

Three code paths, picked at run time (`set_isa`, or `isa=` per call): "avx512" (F/BW/VL),
"avx2" (+FMA, F16C), "portable" (plain C++, any target); "auto" takes the best the CPU has. The
C++ sources (kernels/csrc/quant_*.cpp) are one library: each ISA's translation unit carries its
own target attributes, so the build runs on AVX2-only and AVX-512 CPUs alike and never uses
-march=native. `load_library(portable_only=True)` builds the portable path alone, with no x86
code at all (what a non-x86 target gets; tests/kernels/test_cpu_quant.py checks it). Built at
first use with torch.utils.cpp_extension.load (no torch headers: a few seconds) and cached.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from minisgl.env import ENV
from minisgl.kernels.quant_ref import QuantType, quant_type, row_shape
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

Isa = Literal["avx512", "avx2", "portable"]
ISAS: tuple[Isa, ...] = ("portable", "avx2", "avx512")  # index = the C++ ISA id
# quant_matmul takes the GEMV up to this many activation rows: one thread, SmolLM2's shapes, the GEMV
# is faster up to ~11 rows on AVX2 and ~15 on AVX-512 (tools/bench_cpu_quant.py --rows, 2026-12-01).
GEMV_MAX_ROWS = 12
_CSRC = Path(__file__).with_name("csrc")
_ERRORS = {1: "unsupported type", 2: "ISA not compiled in or not supported by this CPU",
           3: "K is not a multiple of the block size", 4: "out of memory"}  # fmt: skip


@dataclass(frozen=True)
class QuantMatrix:
    """A GGUF tensor's blocks ready for the kernels: validated once, so each call only checks x."""

    weight: torch.Tensor  # [n, row_bytes] uint8, contiguous
    qtype: QuantType
    n: int
    k: int
    # (qtype, weight pointer, row bytes, n, k) for minisgl_quant_run, built once (rebuilt on unpickling)
    desc: ctypes.Array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        desc = (ctypes.c_int64 * 5)(self.qtype.ggml_type, self.weight.data_ptr(), self.weight.shape[1], self.n, self.k)
        object.__setattr__(self, "desc", desc)

    def __reduce__(self) -> tuple[type, tuple[torch.Tensor, QuantType, int, int]]:
        return QuantMatrix, (self.weight, self.qtype, self.n, self.k)

    @staticmethod
    def create(weight: torch.Tensor, qtype: str | int | QuantType) -> QuantMatrix:
        q = quant_type(qtype)
        n, k = row_shape(weight, q)
        return QuantMatrix(weight.contiguous(), q, n, k)


class QuantLib:
    """One build of the C++ kernels, called through ctypes (the GIL is released during a call)."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.minisgl_quant_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
        self._lib = lib
        self._run: Callable[[ctypes.Array, int, int, int, int], int]
        if hasattr(lib, "minisgl_quant_run"):
            lib.minisgl_quant_run.argtypes = [ptr, ptr, ptr, i64, i64]
            self._run = lib.minisgl_quant_run  # bound once: a CDLL attribute lookup per call costs too
        else:  # an older build (tools/bench_cpu_quant.py --ab): its 11-argument entry
            lib.minisgl_quant_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr,
                                                 ctypes.c_int, ctypes.c_int, ctypes.c_int]  # fmt: skip
            f = lib.minisgl_quant_matmul
            self._run = lambda d, x, y, m, fl: f(d[0], d[1], d[2], d[3], x, m, d[4], y, fl & 255, fl >> 8 & 255, fl >> 16)
        self._adopt = getattr(lib, "minisgl_quant_adopt_pool", None)  # not in an older build (bench --ab)
        if self._adopt is not None:
            self._adopt.argtypes = [ptr]
        compiled, cpu = lib.minisgl_quant_isas_compiled(), lib.minisgl_quant_isas_cpu()
        self.compiled: tuple[Isa, ...] = tuple(n for i, n in enumerate(ISAS) if compiled >> i & 1)
        self.supported: tuple[Isa, ...] = tuple(n for i, n in enumerate(ISAS) if (compiled & cpu) >> i & 1)

    def best_isa(self) -> Isa:
        return self.supported[-1]

    def adopt_pool(self, entry: int | None) -> bool:
        """Run this build's jobs on the thread pool behind `entry` (another library's pool entry,
        csrc/pool.h run_here; None: its own pool again); whether an adopted pool runs them now."""
        if self._adopt is None:
            return False
        self._adopt(entry)
        return bool(self._lib.minisgl_quant_pool_adopted())

    def isa_id(self, isa: Isa) -> int:
        """The C++ id of a path this build and CPU run (for `run`); ValueError otherwise."""
        if isa not in self.supported:
            raise ValueError(f"ISA {isa!r} unavailable here (this build and CPU run: {', '.join(self.supported)})")
        return ISAS.index(isa)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor | QuantMatrix, qtype: str | int | QuantType | None,
               isa: Isa, mode: Literal["gemv", "gemm"]) -> torch.Tensor:  # fmt: skip
        qm = weight if isinstance(weight, QuantMatrix) else QuantMatrix.create(weight, qtype)  # type: ignore[arg-type]
        return self.run(x, qm, self.isa_id(isa), 0 if mode == "gemv" else 1)

    def run(self, x: torch.Tensor, qm: QuantMatrix, isa_id: int, mode_id: int) -> torch.Tensor:
        """The lean per-call path: isa_id = ISAS.index(isa) (checked by the caller), mode_id 0 GEMV, 1 GEMM."""
        if x.dtype != torch.float32 or x.shape[-1] != qm.k:
            raise ValueError(f"x must be fp32 [..., {qm.k}] for this {qm.qtype.name} weight, got {x.dtype} {tuple(x.shape)}")
        flat = x.dim() == 2  # reshape/view cost microseconds each: skip them for 2-D inputs
        x2 = x if flat else x.reshape(-1, qm.k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, qm.n, dtype=torch.float32)
        rc = self._run(qm.desc, x2.data_ptr(), y.data_ptr(), rows, isa_id | mode_id << 8 | torch.get_num_threads() << 16)
        if rc:
            raise RuntimeError(f"quantized {'gemv' if mode_id == 0 else 'gemm'} failed: {_ERRORS.get(rc, rc)}")
        return y if flat else y.view(*x.shape[:-1], qm.n)

    def dequantize(self, weight: torch.Tensor, qtype: str | int | QuantType, isa: Isa) -> torch.Tensor:
        q = quant_type(qtype)
        n, k = row_shape(weight, q)
        w = weight.contiguous()
        out = torch.empty(n, k, dtype=torch.float32)
        rc = self._lib.minisgl_quant_dequantize(q.ggml_type, w.data_ptr(), w.shape[1], n, k, out.data_ptr(),
                                                self.isa_id(isa), torch.get_num_threads())  # fmt: skip
        if rc:
            raise RuntimeError(f"quantized dequantize failed: {_ERRORS.get(rc, rc)}")
        return out


_LIBS: dict[bool, QuantLib] = {}
_LOCK = threading.Lock()
_ISA: Isa | Literal["auto"] = "auto"
_ISA_ID: int | None = None  # the resolved default path's C++ id, cached by quant_linear


def build_dir(portable_only: bool = False) -> Path:
    """Named by the sources' digest (cpp_ext.sources_digest): a change of source builds afresh."""
    from minisgl.kernels.cpp_ext import sources_digest

    return ENV.cache_dir / "cpu_quant" / f"{'portable' if portable_only else 'all'}-{sources_digest()}"


def load_library(portable_only: bool = False) -> QuantLib:
    """The built kernels (built on first use, then cached under `build_dir()`); RuntimeError if the
    build fails. `portable_only`: the portable path alone, compiled with no x86 code or flags."""
    with _LOCK:
        if portable_only in _LIBS:
            return _LIBS[portable_only]
        from torch.utils.cpp_extension import load

        name = "minisgl_quant_portable" if portable_only else "minisgl_quant"
        sources = ["quant_dispatch.cpp", "quant_portable.cpp"]
        if not portable_only:
            sources += ["quant_avx2.cpp", "quant_avx512.cpp"]
        directory = build_dir(portable_only)
        directory.mkdir(parents=True, exist_ok=True)
        cached = any(directory.glob(f"{name}*.so"))
        (logger.debug if cached else logger.info)(
            "%s the quantized CPU kernels (%s) in %s", "loading" if cached else "building (first use, ~10 s)",
            "portable only" if portable_only else "avx512 + avx2 + portable", directory)  # fmt: skip
        cflags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
        if portable_only:
            cflags.append("-DQUANT_PORTABLE_ONLY")
        try:
            path = load(name=name, sources=[str(_CSRC / s) for s in sources], extra_cflags=cflags,
                        extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)],
                        build_directory=str(directory), is_python_module=False, verbose=False)  # fmt: skip
        except Exception as exc:  # no compiler: the caller keeps a float path
            raise RuntimeError(f"building the quantized CPU kernels failed ({type(exc).__name__}: {exc})") from exc
        lib = _LIBS[portable_only] = QuantLib(str(path))
    if not portable_only:
        share_pool()
    return lib


def share_pool() -> bool:
    """Run the quantized matmuls on the C++ CPU kernels' thread pool (csrc/pool.h), once both
    libraries are loaded (each load calls this; the portable-only builds keep their own); whether
    they now share it. Each library otherwise has a pool of its own, and on a 2-core machine a
    decode step's alternating calls keep both pools' workers spinning on the one core the other
    library's next job wants (docs/performance.md: "One thread pool for both libraries")."""
    from minisgl.kernels import cpp_ext

    quant, kernels = _LIBS.get(False), cpp_ext.loaded_library()
    return quant is not None and kernels is not None and quant.adopt_pool(kernels.pool_entry())


def set_isa(isa: Isa | Literal["auto"]) -> None:
    """Force one code path for the calls that pass no `isa` ("auto": the best the CPU has)."""
    global _ISA, _ISA_ID
    if isa != "auto" and isa not in ISAS:
        raise ValueError(f"isa must be one of auto, {', '.join(ISAS)}; got {isa!r}")
    _ISA, _ISA_ID = isa, None  # _ISA_ID: resolved (and checked against the CPU) on the next call


def resolve_isa(isa: Isa | Literal["auto"] | None = None, lib: QuantLib | None = None) -> Isa:
    """The path a call with this `isa` argument takes (None: the module's `set_isa` choice)."""
    choice = _ISA if isa is None else isa
    lib = lib or load_library()
    return lib.best_isa() if choice == "auto" else choice


def available_isas() -> tuple[Isa, ...]:
    """The paths this build can run on this CPU, slowest first."""
    return load_library().supported


def quant_linear(x: torch.Tensor, qm: QuantMatrix, isa: Isa | Literal["auto"] | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ W^T -> [..., N] for a prepared QuantMatrix: GEMV up to GEMV_MAX_ROWS rows,
    GEMM beyond. The per-call path of a linear layer (~1 us of Python over the kernel)."""
    global _ISA_ID
    lib = _LIBS.get(False) or load_library()
    if isa is None:
        if _ISA_ID is None:
            _ISA_ID = lib.isa_id(resolve_isa(None, lib))
        isa_id = _ISA_ID
    else:
        isa_id = lib.isa_id(resolve_isa(isa, lib))
    rows = x.numel() // qm.k if qm.k else 0
    return lib.run(x, qm, isa_id, 0 if rows <= GEMV_MAX_ROWS else 1)


def quant_gemv(x: torch.Tensor, weight: torch.Tensor | QuantMatrix, qtype: str | int | QuantType | None = None,
               isa: Isa | Literal["auto"] | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] fp32 @ W^T (W: [N, row_bytes] uint8 GGUF blocks, or a QuantMatrix) -> [..., N];
    for few rows."""
    lib = load_library()
    return lib.matmul(x, weight, qtype, resolve_isa(isa, lib), "gemv")


def quant_gemm(x: torch.Tensor, weight: torch.Tensor | QuantMatrix, qtype: str | int | QuantType | None = None,
               isa: Isa | Literal["auto"] | None = None) -> torch.Tensor:  # fmt: skip
    """As quant_gemv, tiled for many rows (prefill)."""
    lib = load_library()
    return lib.matmul(x, weight, qtype, resolve_isa(isa, lib), "gemm")


def quant_matmul(x: torch.Tensor, weight: torch.Tensor | QuantMatrix, qtype: str | int | QuantType | None = None,
                 isa: Isa | Literal["auto"] | None = None) -> torch.Tensor:  # fmt: skip
    """GEMV up to GEMV_MAX_ROWS activation rows, GEMM beyond."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (quant_gemv if rows <= GEMV_MAX_ROWS else quant_gemm)(x, weight, qtype, isa)


def dequantize(weight: torch.Tensor, qtype: str | int | QuantType,
               isa: Isa | Literal["auto"] | None = None) -> torch.Tensor:  # fmt: skip
    """[N, row_bytes] uint8 blocks -> [N, K] fp32 (equal to quant_ref.dequantize_ref bit for bit)."""
    lib = load_library()
    return lib.dequantize(weight, qtype, resolve_isa(isa, lib))


class QuantOp:
    """The kernels on one code path, chosen once (a layer's choice at load: `isa` is the engine's
    `--cpu-isa`), for the per-call matmuls and embedding-row lookups of the quantized layers."""

    def __init__(self, isa: Isa | Literal["auto"] = "auto") -> None:
        self.lib = load_library()
        self.isa: Isa = resolve_isa(isa, self.lib)
        self._isa_id = self.lib.isa_id(self.isa)  # ValueError for a path this CPU does not run

    def linear(self, x: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
        """x [..., K] fp32 @ W^T: the GEMV up to GEMV_MAX_ROWS rows (decode), the tiled GEMM beyond (prefill)."""
        rows = x.numel() // qm.k if qm.k else 0
        return self.lib.run(x, qm, self._isa_id, 0 if rows <= GEMV_MAX_ROWS else 1)

    def rows(self, qm: QuantMatrix, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int, any shape) of W dequantized: [*ids.shape, K] fp32 (an embedding lookup)."""
        flat = ids.reshape(-1)
        out = self.lib.dequantize(qm.weight.index_select(0, flat), qm.qtype, self.isa)
        return out.view(*ids.shape, qm.k)
