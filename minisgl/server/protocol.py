"""OpenAI request bodies (and the native /generate one), validated strictly.

Every field the server does not implement is either harmless (accepted and ignored: `user`,
`metadata`, ...) or changes the result, in which case a non-default value is rejected with a
400 naming the field. Unknown fields are rejected too: nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from minisgl.core import SamplingParams

ROLES = ("system", "user", "assistant", "developer")


class RequestError(ValueError):
    """A client error: HTTP 400 (or `status`) with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Sampling controls shared by chat and completions, plus unsupported knobs to police."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    max_tokens: int | None = None
    # Harmless: accepted, no effect on the output.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Implemented only at their neutral value.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= 64:
            raise ValueError("n must be between 1 and 64")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and v < 0:
            raise ValueError("temperature must be >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be a positive integer, or -1 / 0 to disable it")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 1:
            raise ValueError("min_p must be in [0, 1]")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_tokens must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return v

    @model_validator(mode="after")
    def _neutral_only(self) -> _SamplingFields:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise RequestError(f"'{name}' is not supported (only 0)", name)
        if self.repetition_penalty not in (None, 1, 1.0):
            raise RequestError("'repetition_penalty' is not supported (only 1.0)", "repetition_penalty")
        if self.logit_bias:
            raise RequestError("'logit_bias' is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("'stream_options' is only allowed with stream=true", "stream_options")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, default_max_tokens: int) -> tuple[SamplingParams, bool]:
        """SamplingParams, and whether max_tokens was given (else: the default is a ceiling)."""
        given = self.requested_max_tokens()
        top_k = None if self.top_k in (None, 0, -1) else self.top_k
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=given if given is not None else default_max_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )
        return params, given is not None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not v:
            raise ValueError("messages must not be empty")
        return [_check_message(i, m) for i, m in enumerate(v)]

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_completion_tokens must be at least 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise RequestError("'logprobs' is not supported", "logprobs")
        if self.top_logprobs:
            raise RequestError("'top_logprobs' is not supported", "top_logprobs")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise RequestError("only response_format {'type': 'text'} is supported", "response_format")
        if self.tools:
            raise RequestError("'tools' are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice' is not supported", "tool_choice")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _check_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    extra = set(message) - {"role", "content", "name"}
    if extra:
        raise ValueError(f"{where}: unsupported field '{sorted(extra)[0]}'")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is None and role != "assistant":
        raise ValueError(f"{where}: 'content' is required")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: content part type {kind!r} is not supported, only 'text'")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"{where}.content[{j}]: a text part is {{'type': 'text', 'text': <string>}}")
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}: 'content' must be a string or a list of text parts")
    if "name" in message and not isinstance(message["name"], str):
        raise ValueError(f"{where}: 'name' must be a string")
    return {"role": "system" if role == "developer" else role, "content": content}


class CompletionRequest(_SamplingFields):
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        normalize_prompts(v)  # raises ValueError with a precise message
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise RequestError("'echo' is not supported", "echo")
        if self.logprobs:
            raise RequestError("'logprobs' is not supported", "logprobs")
        if self.best_of not in (None, self.n):
            raise RequestError("'best_of' is not supported", "best_of")
        if self.suffix:
            raise RequestError("'suffix' is not supported", "suffix")
        return self

    def prompts(self) -> list[str | list[int]]:
        return normalize_prompts(self.prompt)


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> a list of prompts (strings or id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string, a list of strings, token ids or a list of token-id lists")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        for p in prompt:
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ValueError("each token-id list in prompt must be a non-empty list of integers")
        return [list(p) for p in prompt]
    raise ValueError("prompt must be a string, a list of strings, token ids or a list of token-id lists")


class GenerateSampling(_Strict):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None


class GenerateRequest(_Strict):
    """Native endpoint: `{"text" | "input_ids", "sampling_params": {...}, "stream"}`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise RequestError("give exactly one of 'text' and 'input_ids'", "text")
        return self

    def sampling(self) -> SamplingParams:
        sp = self.sampling_params
        try:
            return SamplingParams(
                temperature=sp.temperature, top_k=None if sp.top_k in (0, -1) else sp.top_k,
                top_p=sp.top_p, min_p=sp.min_p, max_tokens=sp.max_new_tokens,
                ignore_eos=sp.ignore_eos, seed=sp.seed, stop_token_ids=list(sp.stop_token_ids or []),
            )  # fmt: skip
        except ValueError as exc:
            raise RequestError(str(exc), "sampling_params") from None

    def stop_list(self) -> list[str]:
        stop = self.sampling_params.stop
        stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        return [s for s in stops if s]


def parse_request(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body into `model`; raise RequestError with one clear message."""
    try:
        return model.model_validate_json(body)
    except RequestError:
        raise
    except ValidationError as exc:
        raise _to_request_error(exc) from None


def _to_request_error(exc: ValidationError) -> RequestError:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return RequestError(f"Malformed JSON body: {err.get('msg')}")
    if kind == "model_type" and not loc:
        return RequestError("The request body must be a JSON object")
    param = ".".join(loc) if loc else None
    # A RequestError raised inside a validator arrives wrapped; keep its own field name.
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, RequestError):
        return RequestError(str(ctx_error), ctx_error.param or param)
    if kind == "extra_forbidden":
        return RequestError(f"Unsupported field '{param}'", param)
    if kind == "missing":
        return RequestError(f"Missing required field '{param}'", param)
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    return RequestError(f"Invalid value for '{param}': {msg}", param)
