"""Messages received by the scheduler processes (rank 0 relays them to the other ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import PoolingParams, SamplingParams
from minisgl.message.codec import wire
from minisgl.message.tokenizer import DetokFacts


@wire(tag=20)
@dataclass(slots=True)
class TokenizedMsg:
    """A validated, tokenized request ready to be scheduled: the tokenizer stage has checked it
    against the context, the vocabulary and the KV pool, and set `sampling.max_tokens` to what
    fits. `facts`: what the detokenizer needs; rank 0 forwards them on its output stream (None:
    plain decoding, no stop strings). `pooling`: an embedding request (prefill only; its vector
    goes to the API server, never the detokenizer)."""

    rid: int
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    facts: DetokFacts | None = None
    pooling: PoolingParams | None = None
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


@wire(tag=21)
@dataclass(slots=True)
class AbortMsg:
    """Stop a request and free what it holds. Also accepted (and forwarded) by the tokenizer."""

    rid: int


@wire(tag=22)
@dataclass(slots=True)
class StatsReqMsg:
    """Ask rank 0 for a `StatsMsg` (sent straight to the API server), tagged with `query_id`."""

    query_id: int


@wire(tag=23)
@dataclass(slots=True)
class ShutdownMsg:
    """Leave the main loop cleanly (used by the launcher before it terminates children)."""

    reason: str = ""


@wire(tag=29)
@dataclass(slots=True)
class LoraAdapterMsg:
    """Load (`path` set) or unload (`path` None) the LoRA adapter `name` on `replica`. Sent by the
    API server to the tokenizer, which forwards it on the replica's request stream, so every
    request sent before it reaches the scheduler first. Rank 0 answers `LoraAdapterReplyMsg`."""

    query_id: int
    replica: int
    name: str
    path: str | None = None


SchedulerMsg = TokenizedMsg | AbortMsg | StatsReqMsg | ShutdownMsg | LoraAdapterMsg
