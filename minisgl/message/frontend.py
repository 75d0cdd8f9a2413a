"""Messages received by the API server (or the interactive shell)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import FinishReason
from minisgl.message.codec import wire


@wire(tag=60)
@dataclass(slots=True)
class TextDelta:
    """New text of one request. `finish_reason` is set on its last delta, with final counts."""

    rid: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@wire(tag=61)
@dataclass(slots=True)
class TextDeltaMsg:
    """All deltas produced from one scheduler step."""

    deltas: list[TextDelta] = field(default_factory=list)


@wire(tag=62)
@dataclass(slots=True)
class ErrorMsg:
    """The request `rid` was rejected; `status` is the HTTP status (400: the client's fault).

    Sent by the tokenizer (validation) or by the scheduler through the detokenizer."""

    rid: int
    message: str
    status: int = 400
    param: str | None = None


@wire(tag=63)
@dataclass(slots=True)
class StatsMsg:
    """Answer to `StatsReqMsg(query_id)`: page and queue counts of scheduler rank 0."""

    query_id: int
    total_pages: int
    free_pages: int
    cached_pages: int
    evictable_pages: int
    running: int
    waiting: int


FrontendMsg = TextDeltaMsg | ErrorMsg | StatsMsg
