"""Plain data shared by every layer: sampling parameters and the per-request state.

Nothing here imports torch, so the API server and tokenizer processes stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


class SamplingError(ValueError):
    """A sampling value out of range; `param` names the field (the server answers 400 with it).

    Messages quote the field as `'param'`, so a front end whose request calls it otherwise
    (`max_completion_tokens`, `sampling_params.max_new_tokens`) can name its own field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def renamed(self, name: str) -> str:
        """The message, naming the field `name` instead of `param`."""
        message = str(self)
        quoted = f"'{self.param}'"
        return message.replace(quoted, f"'{name}'", 1) if quoted in message else f"'{name}': {message}"


# The sampling rules (docs/openai_api.md). OpenAI allows 4 stop strings and 300 biased tokens;
# these are the server's own bounds, each a 400 naming the field past it.
MAX_N = 64  # choices per request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties
MAX_REPETITION_PENALTY = 10.0
BIAS_RANGE = (-100.0, 100.0)
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer


@dataclass
class SamplingParams:
    """Per-request sampling controls, vLLM-shaped; `temperature == 0` means greedy.

    `__post_init__` is the one check of these values, for every front end (HTTP, shell, `LLM`):
    the API's request models only check types and translate their fields into this object.
    What depends on the model (token id ranges, context and KV pool fit) is checked once more
    at the entry, by the tokenizer stage (`RequestTokenizer`); a grammar is compiled by the
    scheduler. Decoding one from the wire does not check again (`unchecked`).
    `n`, `stop` and `include_stop_str_in_output` are read by the front end: `n` fans out into
    requests (`fan_out`), the stop strings go to the detokenizer; the scheduler ignores them."""

    temperature: float = 1.0
    top_k: int | None = None  # None: no top-k cut (0 and -1 are accepted for "none")
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 128
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Applied per request inside a batch (OpenAI/vLLM semantics).
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2], times the count of each generated token
    repetition_penalty: float = 1.0  # (0, 10]; divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # the same for prompt tokens (completions `echo`)
    # Structured output (at most one): a JSON schema (serialized), any JSON object, or a regex.
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    n: int = 1  # samples of the same prompt
    stop: list[str] = field(default_factory=list)  # a str is taken as a list of one; "" is dropped
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        self.stop = [s for s in stops if s]  # an empty stop string stops nothing
        if self.top_k is not None and self.top_k <= 0:
            _check("top_k", self.top_k in (0, -1), "'top_k' must be a positive integer, or -1 / 0 to disable it")
            self.top_k = None  # what other engines accept for "disabled"
        _check("n", 1 <= self.n <= MAX_N, f"'n' must be between 1 and {MAX_N}, got {self.n}")
        _check("temperature", self.temperature >= 0, f"'temperature' must be >= 0, got {self.temperature}")
        _check("top_p", 0.0 < self.top_p <= 1.0, f"'top_p' must be in (0, 1], got {self.top_p}")
        _check("min_p", 0.0 <= self.min_p <= 1.0, f"'min_p' must be in [0, 1], got {self.min_p}")
        _check("max_tokens", self.max_tokens >= 1, f"'max_tokens' must be at least 1, got {self.max_tokens}")
        _check("min_tokens", self.min_tokens >= 0, f"'min_tokens' must be >= 0, got {self.min_tokens}")
        _check("min_tokens", self.min_tokens <= self.max_tokens,
               f"'min_tokens' ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")  # fmt: skip
        low, high = SEED_RANGE
        _check("seed", self.seed is None or low <= self.seed <= high,
               "'seed' must fit a signed 64-bit integer: [-2^63, 2^63 - 1]")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(name, PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1], f"'{name}' must be in [-2, 2], got {value}")
        _check("repetition_penalty", 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"'repetition_penalty' must be in (0, 10], got {self.repetition_penalty}")  # fmt: skip
        self._check_token_controls()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(name, value is None or 0 <= value <= MAX_LOGPROBS, f"'{name}' must be in [0, 20], got {value}")
        structured = sum((self.json_schema is not None, self.json_object, self.regex is not None))
        _check("regex", structured <= 1, "at most one of json_schema, json_object and 'regex' may be set")

    def _check_token_controls(self) -> None:
        """Stop strings, stop token ids and logit bias: counts, sizes, values (the vocabulary
        range is the tokenizer stage's)."""
        stops = self.stop
        _check("stop", len(stops) <= MAX_STOP_STRINGS,
               f"'stop': at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")  # fmt: skip
        _check("stop", all(len(s) <= MAX_STOP_CHARS for s in stops),
               f"'stop': a stop string may have at most {MAX_STOP_CHARS} characters")  # fmt: skip
        ids = self.stop_token_ids
        _check("stop_token_ids", len(ids) <= MAX_STOP_TOKEN_IDS,
               f"'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} stop token ids are supported, got {len(ids)}")  # fmt: skip
        _check("stop_token_ids", all(t >= 0 for t in ids), "'stop_token_ids': token ids must be >= 0")
        bias = self.logit_bias
        _check("logit_bias", len(bias) <= MAX_LOGIT_BIAS,
               f"'logit_bias': at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(bias)}")  # fmt: skip
        _check("logit_bias", all(t >= 0 for t in bias), "'logit_bias': token ids must be >= 0")
        low, high = BIAS_RANGE
        out = [f"{t} ({b})" for t, b in bias.items() if not low <= b <= high]
        _check("logit_bias", not out, "'logit_bias': biases must be in [-100, 100]; out of range for token "
               + ", ".join(out))  # fmt: skip

    @classmethod
    def unchecked(cls, *values: Any) -> SamplingParams:
        """Rebuild from field values checked where the request entered (the wire decoder's
        constructor: a request is validated once, not again in every process it crosses)."""
        params = object.__new__(cls)
        for f, value in zip(fields(cls), values, strict=True):
            setattr(params, f.name, value)
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _copy(getattr(self, f.name)) for f in fields(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SamplingParams:
        return SamplingParams(**data)


def _check(param: str, ok: bool, message: str) -> None:
    if not ok:
        raise SamplingError(message, param)


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value


def fan_out(sampling: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """The `n` requests of one prompt (default `sampling.n`), as every front end makes them: each
    one sample (n=1); with a seed, choice i gets seed + i, so each has its own reproducible
    stream and choice 0 is what n=1 gives."""
    count = sampling.n if n is None else n
    one = sampling if sampling.n == 1 else replace(sampling, n=1)
    if sampling.seed is None:
        return [one] * count
    return [one if i == 0 else replace(one, seed=sampling.seed + i) for i in range(count)]


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request: prefill only (no sampling, no decode); what comes back is the final
    hidden state (after the model's last norm) of the prompt's last token, cut to its first
    `dimensions` values (Matryoshka; None: all of them), then L2-normalized where the model's
    pooler normalizes."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        _check("dimensions", self.dimensions is None or self.dimensions >= 1, "dimensions must be at least 1")


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
    num_pending: int = 0  # output tokens (or an embedding) computed on the device, not yet known on the host
    pooling: PoolingParams | None = None  # an embedding request (its output: one vector, no tokens)
    # The LoRA adapter's uid (lora/manager.py; None: the base model), also its prefix-cache namespace.
    lora_id: int | None = None
    # A LongRoPE prompt past the model's original context: every position rotates with the long
    # factors, so its KV is shared with no other request (never matched in, nor inserted into,
    # the prefix cache).
    long_rope: bool = False
    # Pages before this index that are not cache-owned went back to the pool: behind every
    # layer's sliding window (`PageManager.slide`); their ids in `pages` are stale.
    slid_pages: int = 0

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
