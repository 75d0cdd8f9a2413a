"""Messages received by the tokenizer worker and the detokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core import FinishReason, PoolingParams, SamplingParams
from minisgl.message.codec import wire

# (logprob of the token, [(alternative token id, its logprob)] best first); tuples become lists
# on the wire.
RawLogprob = tuple[float, list[tuple[int, float]]]
RawPromptLogprob = tuple[float | None, list[tuple[int, float]]]

# --- prompt variants (one type per kind of input) -------------------------------------------


@wire(tag=40)
@dataclass(slots=True)
class TextPrompt:
    """Raw text, tokenized as is (special tokens in it are honoured, BOS added per tokenizer)."""

    text: str


@wire(tag=41)
@dataclass(slots=True)
class ChatPrompt:
    """OpenAI chat messages: `{"role": ..., "content": str | [{"type": "text", "text": ...}]}`,
    assistant `tool_calls` and `tool` results included.

    The API server has validated roles and part types; the tokenizer applies the chat template.
    `tools`: OpenAI function tools offered to the model (rendered by the template, or into the
    system prompt when the template has no tool support). `template_kwargs`: extra variables for
    the template (`chat_template_kwargs`, e.g. `enable_thinking`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@wire(tag=42)
@dataclass(slots=True)
class TokenPrompt:
    """Token ids given by the client; checked against the vocabulary."""

    input_ids: list[int]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


# --- to the tokenizer -----------------------------------------------------------------------


@wire(tag=43)
@dataclass(slots=True)
class TokenizeMsg:
    """A new request from the API server.

    `max_tokens_explicit` is False when the client gave no limit: `sampling.max_tokens` is then a
    ceiling that the tokenizer lowers to what fits in the context and the KV pool after the
    prompt, instead of rejecting the request. `include_stop`: a matched stop string (or stop token's text) stays in
    the output. `echo`: the first delta carries the prompt's text (and its logprobs, if asked).
    `pooling`: an embedding request (`/v1/embeddings`): the scheduler sends back one vector.
    `lora`: the LoRA adapter (by name) the request runs on; None: the base model."""

    rid: int
    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_explicit: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    echo: bool = False
    pooling: PoolingParams | None = None
    lora: str | None = None


@wire(tag=47)
@dataclass(slots=True)
class TokenizeQueryMsg:
    """`POST /tokenize`: tokenize (and template) a prompt without running it. Answered with
    `TokensMsg` or `QueryErrorMsg` carrying the same `query_id`."""

    query_id: int
    prompt: Prompt
    add_special_tokens: bool = True


@wire(tag=48)
@dataclass(slots=True)
class DetokenizeQueryMsg:
    """`POST /detokenize`: ids -> text. Answered with `DetokenizedMsg` or `QueryErrorMsg`."""

    query_id: int
    token_ids: list[int]


@wire(tag=49)
@dataclass(slots=True)
class FinishedMsg:
    """Requests a `--dp` replica no longer holds (finished, aborted or refused), sent by its rank 0
    after each step that ended some, so the tokenizer's router forgets their outstanding tokens."""

    rids: list[int]


@wire(tag=59)
@dataclass(slots=True)
class EngineLimitsMsg:
    """Sent once by rank 0 of each replica at start-up: what the tokenizer stage checks every
    request against, as the engine serves it (`context_len`, `vocab_size`, and `pool_tokens`, the
    tokens its KV pool holds). The tokenizer reports ready once every replica's has arrived."""

    context_len: int
    vocab_size: int
    pool_tokens: int


# --- to the detokenizer ---------------------------------------------------------------------


@wire(tag=44)
@dataclass(slots=True)
class DetokFacts:
    """What the detokenizer needs to know about a request, made by the tokenizer stage. It rides
    on `TokenizedMsg` to the scheduler, whose rank 0 puts it on the request's first `TokenOutMsg`
    (before any output of the request), so facts and tokens travel in one ordered stream.

    `prompt_tail_ids`: the last few prompt tokens, so the first output token decodes with the
    same spacing as it would in the full text. `stop`: strings that end the request (not emitted
    unless `include_stop`); they are looked for once `min_tokens` tokens exist. `stop_token_ids`:
    a request ended by one of them reports it as its stop reason, and its text is dropped unless
    `include_stop`. `echo_ids`: the whole prompt, when its text goes back to the client.
    `replica`: the `--dp` replica holding the request, where a stop string's abort goes.
    `reasoning_parser`: the reasoning parser splitting the reply (tokenizer/reasoning.py; chat
    requests of a server with `--reasoning-parser`), `in_reasoning`: the reply starts inside the
    thinking (the prompt opened it)."""

    rid: int
    prompt_tail_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop: bool = False
    min_tokens: int = 0
    echo_ids: list[int] = field(default_factory=list)
    replica: int = 0
    reasoning_parser: str | None = None
    in_reasoning: bool = False


@wire(tag=45)
@dataclass(slots=True)
class TokenOut:
    """New tokens of one request in one scheduler step. The counts are totals so far.

    `logprobs` (requests that asked): per token of `token_ids`, its logprob and the top
    alternatives `[(token_id, logprob)]`, best first. `prompt_logprobs`: the same for every prompt
    token (None for the first), sent once with the first output. `embedding`: an embedding
    request's vector (float32, little-endian), on its only output; rank 0 sends it to the API
    server as an `EmbeddingOut`, not to the detokenizer."""

    rid: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    logprobs: list[RawLogprob] | None = None
    prompt_logprobs: list[RawPromptLogprob] | None = None
    embedding: bytes | None = None


@wire(tag=46)
@dataclass(slots=True)
class TokenOutMsg:
    """Everything one scheduler loop iteration produced, for all its requests: one message per
    step. `new`: the facts of the requests admitted in this iteration, registered before `outs`
    are decoded (a request's facts always come with or before its first output)."""

    outs: list[TokenOut] = field(default_factory=list)
    new: list[DetokFacts] = field(default_factory=list)
