"""The float C++ CPU kernels (RMSNorm, rotary, SiLU-and-mul, GEMV / small GEMM, paged decode
and extend attention, temperature sampling): one shared library built on first use with the system compiler and called through
a small pybind module (kernels/csrc/cpu_bind.cpp: tensor checks and output allocation, ~1-2 us a
call). `kernels/cpu_ops.py` and `kernels/cpu_attention.py`
are the layers' entry points; this module builds, loads and binds the library.

Code paths, picked at run time by the CPU ("auto": the best it runs; `set_isa`, or `isa=` per
call, forces one): "avx512bf16" (AVX-512 plus AVX512-BF16: bf16 GEMV/GEMM and decode attention
on `vdpbf16ps`, bf16 rounding by `vcvtneps2bf16`), "avx512" (F/BW/VL/DQ), "avx2" (+FMA: bf16
loaded and stored by 16-bit shifts, fp32 math) and "portable" (plain C++, any target). fp32 and
bf16 on every path. Each ISA's translation unit (kernels/csrc/cpu_*.cpp)
carries its own target attributes, never -march=native, so one build runs on AVX2-only and
AVX-512 CPUs alike; `load_library(portable_only=True)` builds the portable path alone with no
x86 code (what a non-x86 target gets; the tests build and check it).

The kernels take raw pointers and include no torch headers; only the binding includes the light
ATen headers (not torch/extension.h), and ninja builds it in parallel with the ISA files, so the
cold build takes ~15 s of 2 cores instead of the ~90 s the two torch extensions it replaces took.
It is cached under `build_dir()` and logged once. Shape and dtype errors raise RuntimeError.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any, Literal

import torch

from minisgl.env import ENV
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

Isa = Literal["avx512bf16", "avx512", "avx2", "portable"]
IsaChoice = Isa | Literal["auto"]
ISAS: tuple[Isa, ...] = ("portable", "avx2", "avx512", "avx512bf16")  # index = the C++ ISA id
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("cpu_bind.cpp", "cpu_dispatch.cpp", "cpu_portable.cpp", "cpu_avx2.cpp", "cpu_avx512.cpp",
            "cpu_avx512bf16.cpp")  # fmt: skip


class CpuKernels:
    """One build of the library. Each method has its op's signature plus `isa` (None: the
    module's `set_isa` choice) and returns new tensors."""

    def __init__(self, module: Any) -> None:
        self.path: str = module.__file__
        self.module = self._lib = module  # the binding: each function takes its op's tensors, then the ISA id
        compiled, cpu = module.isas()
        self.compiled: tuple[Isa, ...] = tuple(n for i, n in enumerate(ISAS) if compiled >> i & 1)
        self.supported: tuple[Isa, ...] = tuple(n for i, n in enumerate(ISAS) if (compiled & cpu) >> i & 1)
        self._default: int | None = None  # the resolved `set_isa` choice, cached per generation
        self._generation = -1

    def best_isa(self) -> Isa:
        return self.supported[-1]

    def pool_entry(self) -> int:
        """The address of the library's thread-pool entry (csrc/pool.h run_here)."""
        return int(self.module.pool_entry())

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
        return self.isa_id(isa) == ISAS.index("avx512bf16")

    # Each op: the binding (kernels/csrc/cpu_bind.cpp) checks the tensors (RuntimeError with the
    # op's name) and allocates the outputs.
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, isa: IsaChoice | None = None) -> torch.Tensor:
        """x [..., H] (rows may be strided, unit stride along H), w [H] -> [..., H]."""
        return self._lib.rms_norm(x, w, eps, self.isa_id(isa))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                     isa: IsaChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(rms_norm(x + residual), x + residual) as new tensors; x, residual [..., H] contiguous."""
        return self._lib.add_rms_norm(x, residual, w, eps, self.isa_id(isa))

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               q_eps: float = 0.0, k_eps: float = 0.0,
               isa: IsaChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """q [T, Hq, D], k [T, Hk, D] (any token/head strides, unit stride on D), positions [T]
        int64, cos/sin fp32 [P, D/2]; with q/k norm weights [D] (Qwen3) a per-head RMSNorm first."""
        return self._lib.rotary(positions, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, self.isa_id(isa))

    def silu_and_mul(self, x: torch.Tensor, isa: IsaChoice | None = None) -> torch.Tensor:
        """x [..., 2I] = [gate | up] (unit stride) -> silu(gate) * up [..., I]."""
        return self._lib.silu_and_mul(x, self.isa_id(isa))

    def gemm_rows(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N]: fp32 dot products, one rounding to x's dtype
        (with a bias: F.linear's out + bias). Register-tiled over a few rows; any K."""
        return self._lib.linear(x, w, bias, self.isa_id(isa))

    def gemv(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """x [1, K] @ w [N, K]^T (+ bias) -> [1, N]."""
        if x.dim() != 2 or x.shape[0] != 1:
            raise RuntimeError("gemv: x [1, K], w [N, K]")
        return self._lib.linear(x, w, bias, self.isa_id(isa))

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """q [B, Hq, D]; pools [S, Hkv, D]; table [R, C] int32 slots; rows [B] int64; seq_lens [B]
        int32 -> [B, Hq, D]: each request's query against its first seq_len table entries."""
        return self._lib.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, scale, self.isa_id(isa))

    def extend_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
                         isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """q [T, Hq, D] (fp32/bf16); pools [S, Hkv, D] (fp32/bf16/fp16); table [R, C] int32; rows [B]
        int64; seq_lens, extend_lens [B] int32 -> [T, Hq, D]: causal prefill over cached prefixes."""
        return self._lib.extend_attention(q, k_cache, v_cache, table, rows, seq_lens, extend_lens, scale,
                                          self.isa_id(isa))  # fmt: skip

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
               isa: IsaChoice | None = None) -> torch.Tensor:  # fmt: skip
        """logits [R, N] (fp32/bf16, unit stride on N), temperature [R] (> 0) and uniform [R] (in
        [0, 1)) fp32 -> tokens [R] int64: row r drawn from softmax(logits[r] / temperature[r]) by the
        inverse CDF at uniform[r] (kernels/csrc/cpu_sample.h)."""
        return self._lib.sample(logits, temperature, uniform, self.isa_id(isa))


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


def sources_digest() -> str:
    """A digest of every file in kernels/csrc and of the directory's own path: the build directories
    are named by it, so checkouts with different sources (an upgrade) never rebuild each other's
    library in place, and neither do two checkouts of the same sources (torch's build.ninja names
    the sources by absolute path, so a second checkout would rebuild the first one's library)."""
    h = hashlib.sha256(str(_CSRC.resolve()).encode() + b"\0")
    for f in sorted(_CSRC.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def build_dir(portable_only: bool = False) -> Path:
    return ENV.cache_dir / "cpu_kernels" / f"{'portable' if portable_only else 'all'}-{sources_digest()}"


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
        sources = _SOURCES[:3] if portable_only else _SOURCES
        directory = build_dir(portable_only)
        directory.mkdir(parents=True, exist_ok=True)
        cached = any(directory.glob(f"{name}*.so"))
        if not cached:
            logger.info("building the C++ CPU kernels, once (%s; ~20 s on 2 idle cores) in %s",
                        "portable only" if portable_only else "avx512bf16 + avx512 + avx2 + portable", directory)  # fmt: skip
        cflags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-maybe-uninitialized",
                  "-Wno-uninitialized"]  # fmt: skip
        if portable_only:
            cflags.append("-DCPU_PORTABLE_ONLY")
        start = time.perf_counter()
        try:
            module = load(name=name, sources=[str(_CSRC / s) for s in sources], extra_cflags=cflags,
                          extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)],
                          build_directory=str(directory), is_python_module=True, verbose=False)  # fmt: skip
        except Exception as exc:  # no compiler: the callers keep their torch paths
            _FAILED[portable_only] = f"building the C++ CPU kernels failed ({type(exc).__name__}: {exc})"
            raise RuntimeError(_FAILED[portable_only]) from exc
        lib = _LIBS[portable_only] = CpuKernels(module)
        if not portable_only:
            from minisgl.kernels import cpu_quant

            cpu_quant.share_pool()  # the quantized kernels' library, if loaded, runs on this one's pool
        logger.info("C++ CPU kernels %s in %.1f s (paths this CPU runs: %s; auto takes %s)",
                    "loaded" if cached else "built", time.perf_counter() - start, ", ".join(lib.supported),
                    lib.best_isa())  # fmt: skip
        return lib


def loaded_library() -> CpuKernels | None:
    """The full build if it is loaded already (never builds or loads it)."""
    return _LIBS.get(False)


_WARNED: set[str] = set()


def load_or_warn(flag: str, what: str) -> CpuKernels | None:
    """The library, or None after one warning naming why and `flag`, the switch that hides it.
    Calls without an `isa` then take the path `--cpu-isa` (KernelConfig.cpu_isa) names: "avx512"
    is the AVX-512 BF16 path where the CPU has it, else plain AVX-512F."""
    from minisgl.platform import current

    try:
        lib = _LIBS.get(False) or load_library()
    except RuntimeError as exc:
        if flag not in _WARNED:
            _WARNED.add(flag)
            logger.warning("%s unavailable (%s); using the torch path (%s hides this)", what, exc, flag)
        return None
    choice = current().kernels.cpu_isa
    if choice == "avx512" and "avx512bf16" in lib.supported:
        choice = "avx512bf16"
    if choice != _CHOICE.isa:
        set_isa(choice)  # type: ignore[arg-type]
    return lib
