from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 256
    # Prefill tokens per step (decodes are not counted); None: the platform's offline default.
    max_prefill_tokens: int | None = 8192
    cache: Literal["radix", "naive"] = "radix"
    # Pages kept back per running request for decode growth when admitting new requests.
    decode_reserve_tokens: int = 64
    # Plan step N+1 while step N runs (--overlap-schedule / --no-overlap-schedule). None: the platform decides (on where the device runs
    # asynchronously to the host). Forcing it on CPU exercises the same code path in tests.
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


class PlatformFacts(Protocol):
    """The device questions `resolve` asks (answered by `minisgl.platform`'s platform objects)."""

    @property
    def name(self) -> str: ...

    def offline_prefill_tokens(self) -> int: ...


def device_runs_async(platform: PlatformFacts) -> bool:
    """Whether the device runs asynchronously to the host, so planning the next step while the
    current one runs pays (CUDA); on CPU the "device" is the host itself."""
    return platform.name == "cuda"


def resolve(config: SchedulerConfig, platform: PlatformFacts) -> SchedulerConfig:
    """The automatic choices made: `overlap` and `max_prefill_tokens` are never None after this."""
    overlap = device_runs_async(platform) if config.overlap is None else config.overlap
    budget = platform.offline_prefill_tokens() if config.max_prefill_tokens is None else config.max_prefill_tokens
    return replace(config, overlap=overlap, max_prefill_tokens=budget)
