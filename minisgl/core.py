"""Plain data shared by every layer: sampling parameters and the per-request state.

Nothing here imports torch, so the API server and tokenizer processes stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """Per-request sampling controls. `temperature == 0` means greedy."""

    temperature: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 128
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Applied per request inside a batch (OpenAI/vLLM semantics).
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2], times the count of each generated token
    repetition_penalty: float = 1.0  # > 0; divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # the same for prompt tokens (completions `echo`)
    # Structured output (at most one): a JSON schema (serialized), any JSON object, or a regex.
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            # 0 and -1 are what other engines accept for "disabled"; normalise them.
            if self.top_k in (0, -1):
                self.top_k = None
            else:
                raise ValueError(f"top_k must be a positive integer or -1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100.0 <= bias <= 100.0 for bias in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {value}")
        if sum((self.json_schema is not None, self.json_object, self.regex is not None)) > 1:
            raise ValueError("at most one of json_schema, json_object and regex may be set")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": dict(self.logit_bias),
            "min_tokens": self.min_tokens,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "json_schema": self.json_schema,
            "json_object": self.json_object,
            "regex": self.regex,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "SamplingParams":
        return SamplingParams(**data)


@dataclass(slots=True, eq=False)
class Req:
    """One request as the scheduler sees it.

    Lengths (one meaning each):
      prompt_len   tokens of the prompt
      output_len   tokens generated so far
      cached_len   tokens whose KV is valid in this request's pages
      extend_len   tokens computed in the current step
      prefix_len   prompt tokens found in the prefix cache at admission (reported as cached_tokens)
    """

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    max_total_len: int = 1 << 30  # the model's context length
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    extend_len: int = 0
    prefix_len: int = 0
    row: int | None = None  # row of the token table while resident
    pages: list[int] = field(default_factory=list)  # pages holding this request's KV, in order
    shared_pages: int = 0  # leading pages owned by the prefix cache (not freed by this request)
    cache_handle: Any = None  # locked prefix-cache node, or None
    finish_reason: FinishReason | None = None
    arrival: int = 0  # admission order, used to pick the victim when retracting
    num_pending: int = 0  # output tokens sampled on the device but not yet known on the host

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, begin: int, end: int) -> list[int]:
        """all_ids[begin:end] without building all_ids (the per-step hot path)."""
        prompt_len = len(self.prompt_ids)
        if begin >= prompt_len:
            return self.output_ids[begin - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_ids[begin:end]
        return self.prompt_ids[begin:] + self.output_ids[: end - prompt_len]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def uncomputed_len(self) -> int:
        """Known tokens whose KV is not yet computed; a new token is sampled once this reaches 0.

        1 while decoding; more while (re)filling the prompt, chunk by chunk."""
        return self.total_len - self.cached_len

    def finish_reason_at(self, index: int) -> FinishReason | None:
        """Whether output token `index` ends the request (tokens after it are then dropped)."""
        token = self.output_ids[index]
        count = index + 1
        if not self.sampling.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in self.sampling.stop_token_ids:
            return "stop"
        if count >= self.sampling.max_tokens or self.prompt_len + count >= self.max_total_len:
            return "length"
        return None

    @property
    def done_by_length(self) -> bool:
        """Already at max_tokens or the context limit (possibly counting pending tokens)."""
        return self.output_len >= self.sampling.max_tokens or self.total_len >= self.max_total_len
