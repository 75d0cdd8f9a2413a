from __future__ import annotations

import contextlib
import ctypes
import os
from functools import cache
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from minisgl.env import ENV
from minisgl.platform.base import BasePlatform
from minisgl.utils.memory import pin_mmap_threshold, trim_heap


_OPENMP_LIBS = ("libgomp", "libomp", "libiomp")


@cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's intra-op threads come from (torch/lib's libgomp on Linux
    wheels, libomp on macOS), checked to be the one `torch.get_num_threads()` reads; None where
    torch has another parallel backend or the library is elsewhere."""
    root = Path(torch.__file__).parent
    folders = [folder for folder in (root / "lib", root.parent / "torch.libs") if folder.is_dir()]
    names = sorted(p for folder in folders for p in folder.iterdir() if p.name.startswith(_OPENMP_LIBS))
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return None
    threads = torch.get_num_threads()
    for path in names:
        try:  # only a library torch has loaded already (the same handle): never a second runtime
            lib = ctypes.CDLL(str(path), mode=no_load | os.RTLD_LAZY)
        except OSError:
            continue
        if not hasattr(lib, "omp_set_num_threads"):
            continue
        lib.omp_set_num_threads(threads + 1)
        follows = torch.get_num_threads() == threads + 1
        lib.omp_set_num_threads(threads)
        if follows:
            return lib
    return None


# Allocations of at least this many bytes get their own mmap in the CPU scheduler process
# (`CpuPlatform.prepare_scheduler_process`); 4 MiB still grew 129 MiB (docs/performance.md).
SCHEDULER_MMAP_THRESHOLD = 1 << 20


class _NoopEvent:
    """Stand-in for a CUDA event: CPU work is synchronous, so it is always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoopStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


def cpu_has_native_bf16() -> bool:
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


class CpuPlatform(BasePlatform):
    name = "cpu"
    dist_backend = "gloo"
    supports_graphs = False
    pin_memory = False
    default_attn = "torch"
    compiles_triton = False
    # `--dtype auto`: bf16 where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX): about 2x
    # the fp32 GEMM rate and half the bytes per decoded token. fp32 elsewhere, and whenever exact
    # agreement with fp32 Hugging Face matters (`--dtype float32`; the test suite pins it:
    # tests/conftest.py).
    default_dtype = torch.float32

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.default_dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        self.triton_interpret = ENV.triton_interpret
        self._stream = _NoopStream()

    def offline_prefill_tokens(self) -> int:
        # 2048-token chunks: W2's 32 prompts offline (bench offline, 64-512 tokens, 128 out, the
        # embedded GGUF on a 2-core Zen 5) took 15.8 / 16.4 s against 18.0 / 18.1 s in 8192-token
        # chunks (prefill alone 8.8-9.3 s against 11.1-15.9; 1024 and 4096 within 2 % of 2048):
        # a chunk's temporaries (the gate/up output alone is rows x 3072 fp32) stay small. The
        # server's CPU default (server/engine_args.py CPU_SERVER_PREFILL_TOKENS) is the same figure,
        # written there again because the flag parser stays torch-free.
        return 2048

    def set_device(self) -> None:
        if ENV.num_threads > 0:
            torch.set_num_threads(ENV.num_threads)

    @contextlib.contextmanager
    def serial_torch_ops(self) -> Iterator[None]:
        """torch's intra-op threads off inside: the sampler's elementwise ops over 49k-entry
        logits rows pass torch's 32k-element grain and open an OpenMP region, which ends in a
        barrier waiting for every thread it split to. On a 2-core machine that thread competes
        with the C++ kernels' pool workers (still spinning after the LM head) and with other
        processes: a W1 step's one division took 0.3 ms idle and 8-12 ms on a loaded machine
        (bench profile table), ~20 us on one thread; and the OpenMP worker then spins ~300k
        pauses on a core the next step's GEMVs need.

        Through the OpenMP runtime's own `omp_set_num_threads` (~0.4 us each way), which is what
        torch's thread count reads: `torch.set_num_threads` would also switch MKL's dynamic
        threading off for good (nested MKL regions inside torch's SDPA from then on). Where the
        runtime is not found (`_openmp_runtime`), nothing changes. The C++ kernels read torch's
        thread count per call, so it is restored on exit."""
        omp = _openmp_runtime()
        threads = torch.get_num_threads()
        if omp is None or threads == 1:
            yield
            return
        omp.omp_set_num_threads(1)
        try:
            yield
        finally:
            omp.omp_set_num_threads(threads)

    def new_stream(self) -> _NoopStream:
        return _NoopStream()

    def new_event(self) -> _NoopEvent:
        return _NoopEvent()

    def current_stream(self) -> _NoopStream:
        return self._stream

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        yield

    def free_memory(self) -> int:
        return int(psutil.virtual_memory().available)

    def release_idle_memory(self) -> None:
        # A prefill's activations (tens of MB per op) are freed into malloc's heap, which keeps
        # them: ~200 MB of SmolLM2's server after 32 prompts of up to 512 tokens. malloc_trim
        # returns every free page of it (a few ms; only when the scheduler has nothing to do).
        trim_heap()

    def prepare_scheduler_process(self) -> None:
        """The mmap threshold pinned at SCHEDULER_MMAP_THRESHOLD (utils/memory.pin_mmap_threshold),
        so the large temporaries of a forward (activations, logits) are mapped and unmapped rather
        than left in a heap that grows while requests decode (the dynamic threshold's heap:
        tests/e2e/test_hostile.py's 10 unread streams grew the scheduler by ~75-125 MiB).
        docs/performance.md, "The scheduler's malloc (seventeenth session)", has the A/B the value
        comes from. Nothing where there is no glibc."""
        pin_mmap_threshold(SCHEDULER_MMAP_THRESHOLD)

    def kv_budget(self, memory_fraction: float) -> int:
        # Host memory is shared with everything else: a quarter of what is free, at most 4 GiB.
        return min(4 << 30, self.free_memory() // 4)

    def synchronize(self) -> None:
        pass
