"""Messages received by the API server (or the interactive shell)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import FinishReason
from minisgl.message.codec import wire


@wire(tag=64)
@dataclass(slots=True)
class TopLogprob:
    """One alternative: the token's text (`raw`: its exact bytes) and logprob."""

    token_id: int
    token: str
    raw: bytes
    logprob: float


@wire(tag=65)
@dataclass(slots=True)
class TokenLogprob:
    """A chosen token (`logprob` None: the first prompt token, which has none) and the top
    alternatives at its position, best first."""

    token_id: int
    token: str
    raw: bytes
    logprob: float | None
    top: list[TopLogprob] = field(default_factory=list)


@wire(tag=60)
@dataclass(slots=True)
class TextDelta:
    """New text of one request. `finish_reason` is set on its last delta, with final counts.

    `stop_reason`: what ended a "stop" finish: the stop string, or the stop token id (None: EOS).
    `logprobs`: one entry per id of `token_ids` (requests that asked). `prompt_text` and
    `prompt_logprobs` come once, on the first delta of an `echo` request. `reasoning`: new thinking
    text, apart from the answer in `text` (requests with a reasoning parser)."""

    rid: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""


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


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Page and queue counts of a scheduler (`Scheduler.stats()`); the counts `StatsMsg` carries.

    Defined here, not in `minisgl.scheduler`, so the API server reads it without importing torch."""

    total_pages: int
    free_pages: int
    cached_pages: int
    evictable_pages: int
    running: int
    waiting: int


@wire(tag=63)
@dataclass(frozen=True, slots=True)
class StatsMsg(SchedulerStats):
    """Answer to `StatsReqMsg(query_id)`: the `SchedulerStats` of one replica's scheduler rank 0,
    the prompt tokens of every admitted request so far with how many of them the prefix cache
    held, and the requests the replica has received and aborted (`--dp` routing).

    Fields (and so the wire order): the `SchedulerStats` counts first, then `query_id` onward."""

    query_id: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    aborted: int = 0
    # Speculative decoding (zero when off): verify rows, tokens proposed in them, proposals accepted.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@wire(tag=66)
@dataclass(slots=True)
class TokensMsg:
    """Answer to `TokenizeQueryMsg`: the prompt's token ids (chat template applied)."""

    query_id: int
    token_ids: list[int]


@wire(tag=67)
@dataclass(slots=True)
class DetokenizedMsg:
    """Answer to `DetokenizeQueryMsg`."""

    query_id: int
    text: str


@wire(tag=68)
@dataclass(slots=True)
class QueryErrorMsg:
    """A tokenize / detokenize query the tokenizer refused (HTTP 400 naming `param`)."""

    query_id: int
    message: str
    param: str | None = None


@wire(tag=69)
@dataclass(slots=True)
class EmbeddingOut:
    """The vector of one embedding request (float32, little-endian; pooled, cut to the request's
    dimensions and normalized by the engine), with its prompt's token counts. It ends the request."""

    rid: int
    embedding: bytes
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason = "stop"


@wire(tag=70)
@dataclass(slots=True)
class EmbeddingMsg:
    """The embedding requests one scheduler step finished (sent by rank 0 straight to the API server)."""

    outs: list[EmbeddingOut] = field(default_factory=list)


@wire(tag=79)
@dataclass(slots=True)
class LoraAdapterReplyMsg:
    """Answer to `LoraAdapterMsg`: `status` 200 (done) or the HTTP status of the refusal."""

    query_id: int
    status: int = 200
    message: str = ""


QueryReply = StatsMsg | TokensMsg | DetokenizedMsg | QueryErrorMsg | LoraAdapterReplyMsg
FrontendMsg = TextDeltaMsg | ErrorMsg | EmbeddingMsg | QueryReply
