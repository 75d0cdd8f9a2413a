"""Results of `LLM.generate` / `LLM.chat`, shaped like vLLM's (`RequestOutput`, `CompletionOutput`,
`Logprob`), built from the detokenizer's `TextDelta`s: the same text, token ids, finish and stop
reasons and logprobs the server sends.

Logprobs are per position a dict `token_id -> Logprob(logprob, rank, decoded_token)`: the chosen
token and the top alternatives, best first. `rank` is the place in the vocabulary (1: the most
likely); the chosen token's rank is known when it is among the alternatives, else None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import FinishReason
from minisgl.message.frontend import TextDelta, TokenLogprob

PositionLogprobs = dict[int, "Logprob"]


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt. `stop_reason`: the stop string or stop token id that ended a "stop"
    finish (None: EOS or not stopped). `logprobs` / `cumulative_logprob`: None unless asked.
    `reasoning_content`: the thinking of a `chat` reply, apart from `text` (None without a
    reasoning parser or when the reply had none)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    reasoning_content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One prompt: its `n` samples in `outputs`. `prompt`: the text the ids came from (the
    templated conversation for `chat`; None for token ids). `prompt_logprobs`: None at the first
    position, which has nothing to condition on."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(out.finished for out in self.outputs)


def position_logprobs(entry: TokenLogprob) -> PositionLogprobs:
    ranked = {alt.token_id: Logprob(alt.logprob, rank, alt.token) for rank, alt in enumerate(entry.top, start=1)}
    if entry.token_id in ranked:
        return ranked
    assert entry.logprob is not None
    return {entry.token_id: Logprob(entry.logprob, None, entry.token), **ranked}


class OutputBuilder:
    """Folds one request's `TextDelta`s into its `CompletionOutput` (O(1) per delta token)."""

    def __init__(self, index: int, want_logprobs: bool) -> None:
        self.out = CompletionOutput(index, logprobs=[] if want_logprobs else None,
                                    cumulative_logprob=0.0 if want_logprobs else None)  # fmt: skip
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.cached_tokens = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None

    def add(self, delta: TextDelta) -> None:
        out = self.out
        if delta.text:
            self._text.append(delta.text)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        out.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None and out.logprobs is not None:
            for entry in delta.logprobs:
                out.logprobs.append(position_logprobs(entry))
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + (entry.logprob or 0.0)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None if e.logprob is None else position_logprobs(e) for e in delta.prompt_logprobs]
        self.cached_tokens = delta.cached_tokens
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.stop_reason = delta.stop_reason
            out.text = "".join(self._text)
            out.reasoning_content = "".join(self._reasoning) or None

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None
