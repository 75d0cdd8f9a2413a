from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol, get_args

# Speculative decoding (scheduler/speculative.py): who proposes the tokens the target verifies.
SpeculativeAlgorithm = Literal["ngram", "draft"]


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
    # Speculative decoding: None off; "ngram" proposes continuations of the request's latest
    # n-gram (n from max to min) found earlier in its own tokens; "draft" runs a small model
    # (`speculative_draft_model`, same tokenizer) greedily. Up to `num_speculative_tokens` per step.
    speculative_algorithm: SpeculativeAlgorithm | None = None
    num_speculative_tokens: int = 4
    speculative_draft_model: str | None = None
    speculative_ngram_max: int = 3
    speculative_ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', got {self.cache!r}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is not None and algo not in get_args(SpeculativeAlgorithm):
            raise ValueError(f"speculative_algorithm must be 'ngram' or 'draft', got {algo!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("speculative n-gram sizes need 1 <= speculative_ngram_min <= speculative_ngram_max")
        if (algo == "draft") != (self.speculative_draft_model is not None):
            raise ValueError("speculative_algorithm 'draft' and speculative_draft_model go together")


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
    # A speculating request's next proposal needs its committed tokens on the host: no overlap.
    overlap = overlap and config.speculative_algorithm is None
    budget = platform.offline_prefill_tokens() if config.max_prefill_tokens is None else config.max_prefill_tokens
    return replace(config, overlap=overlap, max_prefill_tokens=budget)
