from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal

import torch


class BasePlatform(ABC):
    name: Literal["cpu", "cuda"]
    device: torch.device
    dist_backend: Literal["gloo", "nccl"]
    supports_graphs: bool
    pin_memory: bool
    default_attn: str
    default_dtype: torch.dtype

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
    def synchronize(self) -> None: ...

    def offline_prefill_tokens(self) -> int:
        """Prefill tokens per step when an offline run (`LLM`, `bench offline`) sets none: the
        server keeps 8192 for latency; offline jobs only care about throughput."""
        return 8192

    def set_device(self) -> None:
        """Bind this process to its device (no-op on CPU)."""
