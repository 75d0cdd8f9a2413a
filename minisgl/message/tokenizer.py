"""Messages received by the tokenizer worker and the detokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core import FinishReason, SamplingParams
from minisgl.message.codec import wire

# --- prompt variants (one type per kind of input) -------------------------------------------


@wire(tag=40)
@dataclass(slots=True)
class TextPrompt:
    """Raw text, tokenized as is (special tokens in it are honoured, BOS added per tokenizer)."""

    text: str


@wire(tag=41)
@dataclass(slots=True)
class ChatPrompt:
    """OpenAI chat messages: `{"role": ..., "content": str | [{"type": "text", "text": ...}]}`.

    The API server has validated roles and part types; the tokenizer applies the chat template."""

    messages: list[dict[str, Any]]


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
    ceiling that the tokenizer lowers to what fits in the context after the prompt, instead of
    rejecting the request."""

    rid: int
    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_explicit: bool = True
    stop: list[str] = field(default_factory=list)


# --- to the detokenizer ---------------------------------------------------------------------


@wire(tag=44)
@dataclass(slots=True)
class DetokRegisterMsg:
    """Sent by the tokenizer before the request reaches the scheduler.

    `prompt_tail_ids`: the last few prompt tokens, so the first output token decodes with the
    same spacing as it would in the full text. `stop`: strings that end the request (not emitted)."""

    rid: int
    prompt_tail_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)


@wire(tag=45)
@dataclass(slots=True)
class TokenOut:
    """New tokens of one request in one scheduler step. The counts are totals so far."""

    rid: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


@wire(tag=46)
@dataclass(slots=True)
class TokenOutMsg:
    """Everything one scheduler step produced, for all its requests: one message per step."""

    outs: list[TokenOut] = field(default_factory=list)
