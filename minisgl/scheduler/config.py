from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 256
    # Prefill tokens per step (decodes are not counted); None: the platform's offline default.
    max_prefill_tokens: int | None = 8192
    cache: Literal["radix", "naive"] = "radix"
    # Pages kept back per running request for decode growth when admitting new requests.
    decode_reserve_tokens: int = 64
    # Plan step N+1 while step N runs (--overlap-schedule / --no-overlap-schedule). None: on where
    # the device is asynchronous (CUDA). Forcing it on CPU exercises the same code path in tests.
    overlap: bool | None = None
    # A request whose prompt shares whole pages with a resident request still computing them
    # waits for them to reach the prefix cache instead of computing them again (n > 1 samples).
    dedupe_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', got {self.cache!r}")
