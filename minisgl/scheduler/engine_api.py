"""What the scheduler needs from the engine it is handed: `Engine` satisfies it, and so does the
model-free fake engine of the unit tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from minisgl.core import Req
from minisgl.engine.step import LogprobEntry, PromptChunk, StepPlan
from minisgl.models.pooling import PoolerConfig
from minisgl.scheduler.config import PlatformFacts


class PoolFacts(Protocol):
    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...


class ModelFacts(Protocol):
    @property
    def eos_ids(self) -> Sequence[int]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def long_rope_from(self) -> int | None: ...  # LongRoPE's original context (`Req.long_rope`)

    @property
    def kv_window(self) -> int | None: ...  # the window of every layer; None: some layer is global


class EngineLimits(Protocol):
    @property
    def max_running_requests(self) -> int: ...  # rows of the engine's token table


class LaunchedStepLike(Protocol):
    """A step queued on the device (`LaunchedStep`)."""

    @property
    def sampled_reqs(self) -> list[Req]: ...  # requests that sample a token, in order

    def result(self) -> list[int]: ...  # their tokens (waits for the device)

    def token_logprobs(self) -> list[LogprobEntry | None]: ...

    def prompt_logprob_chunks(self) -> list[tuple[PromptChunk, list[LogprobEntry]]]: ...

    @property
    def pooled(self) -> PooledLike | None: ...  # embedding requests that completed their prompt


class PooledLike(Protocol):
    """Embedding requests of a launched step (`engine.pooling.PooledRows`)."""

    @property
    def reqs(self) -> list[Req]: ...

    def embeddings(self) -> list[bytes]: ...  # per request, float32 little-endian (waits for the device)


class SchedulerEngine(Protocol):
    @property
    def pool(self) -> PoolFacts: ...

    @property
    def context_len(self) -> int: ...

    @property
    def model_config(self) -> ModelFacts: ...

    @property
    def config(self) -> EngineLimits: ...

    @property
    def platform(self) -> PlatformFacts: ...

    @property
    def model_dir(self) -> Path: ...  # where a structured-output request's tokenizer is read

    @property
    def pooler(self) -> PoolerConfig | None: ...  # an embedding model's pooler; None: text generation

    def launch(self, plan: StepPlan, prev: Any = None) -> LaunchedStepLike:
        """Queue `plan` on the device; `prev` is the step still in flight (`plan.from_prev`)."""
        ...
