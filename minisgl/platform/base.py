from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch

from minisgl.platform.kernel_config import KernelConfig, resolve_kernels


class BasePlatform(ABC):
    name: Literal["cpu", "cuda"]
    device: torch.device
    dist_backend: Literal["gloo", "nccl"]
    supports_graphs: bool
    pin_memory: bool
    default_attn: str
    default_dtype: torch.dtype
    # Triton kernels compile for this device (on CPU they only run in Triton's interpreter, for tests).
    compiles_triton: bool
    # Programmatic dependent launch (sm90+).
    supports_pdl: bool = False
    # Triton's interpreter is on (TRITON_INTERPRET=1): the triton backend may run on the CPU, slowly.
    triton_interpret: bool = False
    # `--pad-eager` unset: pad eager steps' row counts to a few sizes (cuBLAS picks its kernels per
    # GEMM shape, so new shapes cost; engine/graph.py: padded_rows).
    pad_eager: bool = False
    _kernels: KernelConfig | None = None

    @abstractmethod
    def new_stream(self) -> Any: ...

    @abstractmethod
    def new_event(self) -> Any: ...

    @abstractmethod
    def current_stream(self) -> Any: ...

    @abstractmethod
    def stream_context(self, stream: Any) -> Any: ...

    @abstractmethod
    def free_memory(self) -> int:
        """Bytes the engine may still allocate on the device."""

    @abstractmethod
    def kv_budget(self, memory_fraction: float) -> int:
        """Bytes the KV pool may take when neither --num-pages nor --kv-cache-gb says."""

    @abstractmethod
    def synchronize(self) -> None: ...

    def empty_cache(self) -> None:
        """Hand cached, unused device memory back (before the engine sizes its KV pool)."""

    def release_idle_memory(self) -> None:
        """Called when the scheduler goes idle: hand freed memory that the process's allocator
        keeps back to the OS (no-op here; CPU: the C heap, where activations live)."""

    def prepare_scheduler_process(self) -> None:
        """Called once in a scheduler process, before its model loads (no-op here; CPU: the C
        heap's mmap threshold)."""

    def offline_prefill_tokens(self) -> int:
        """Prefill tokens per step when an offline run (`LLM`, `bench offline`) sets none: the
        server keeps 8192 for latency; offline jobs only care about throughput."""
        return 8192

    def set_device(self) -> None:
        """Bind this process to its device (no-op on CPU)."""

    def serial_torch_ops(self) -> contextlib.AbstractContextManager[None]:
        """A region whose torch ops run on the calling thread alone, for host work too small to
        split (CPU: CpuPlatform's; here, on a device, nothing changes)."""
        return contextlib.nullcontext()

    @property
    def kernels(self) -> KernelConfig:
        """The kernel choices of this process (resolved for this platform): the engine sets them
        before it builds the model (`use_kernels`); until then, the defaults."""
        if self._kernels is None:
            self._kernels = resolve_kernels(KernelConfig(), self)
        return self._kernels

    def use_kernels(self, kernels: KernelConfig) -> None:
        """Set once per engine, before its layers are built: they pick their implementation from it."""
        self._kernels = resolve_kernels(kernels, self)
