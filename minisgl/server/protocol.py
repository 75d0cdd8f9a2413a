"""OpenAI request bodies (and the native /generate one), validated strictly.

Every field the server does not implement is either harmless (accepted and ignored: `user`,
`metadata`, ...) or changes the result, in which case a non-default value is rejected with a
400 naming the field. Unknown fields are rejected too: nothing is silently ignored.
Chat bodies (messages, tools) are in chat_protocol.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator

from minisgl.core import SamplingError, SamplingParams


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
    """Sampling controls shared by chat and completions (OpenAI's, plus vLLM/SGLang extensions:
    top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output,
    ignore_eos, regex).

    The model checks types only; the values are checked once, by `SamplingParams` (core.py),
    which parsing builds (`_build_sampling`): a bad value is a 400 naming this body's field."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    # Harmless: accepted, no effect on the output.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    _sampling: SamplingParams = PrivateAttr()

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # JSON object keys are strings: this body's own shape. The ids and biases are checked by SamplingParams.
        keys = [k for k in (v or {}) if not k.isdigit()]
        if keys:
            raise ValueError("keys must be token ids (non-negative integers as strings), got "
                             + ", ".join(repr(k) for k in keys))  # fmt: skip
        return v

    @field_validator("regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        # Not a sampling rule: whether a grammar compiles is the scheduler's (it needs the engine's
        # tokenizer). Python's parser catches the common slip early, with a 400 naming the field.
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _build_sampling(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise RequestError("'stream_options' is only allowed with stream=true", "stream_options")
        json_schema, json_object = structured_output(self.response_format)
        logprobs, prompt_logprobs = self.logprob_counts()
        given = self.requested_max_tokens()
        fields = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p,
            # Unset: a placeholder that `sampling` replaces with the route's default.
            max_tokens=given if given is not None else max(1, self.min_tokens),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            json_schema=json_schema,
            json_object=json_object,
            regex=self.regex,
            stop=[] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop),
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        self._sampling = checked_sampling(fields, self.field_name)
        return self

    def field_name(self, param: str) -> str:
        """This body's name for a SamplingParams field."""
        return param

    def stop_list(self) -> list[str]:
        return list(self._sampling.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams."""
        return None, None

    def sampling(self, default_max_tokens: int) -> tuple[SamplingParams, bool]:
        """The validated SamplingParams, and whether max_tokens was given (else the route's
        default, which the tokenizer stage treats as a ceiling)."""
        params = self._sampling
        given = self.requested_max_tokens() is not None
        if not given:
            params = replace(params, max_tokens=max(default_max_tokens, params.min_tokens))
        return params, given

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def checked_sampling(fields: dict[str, Any], field_name: Callable[[str], str]) -> SamplingParams:
    """SamplingParams(**fields), its SamplingError as a 400 naming the body's field."""
    try:
        return SamplingParams(**fields)
    except SamplingError as exc:
        name = field_name(exc.param)
        raise RequestError(exc.renamed(name), name) from None


def structured_output(response_format: dict[str, Any] | None) -> tuple[str | None, bool]:
    """OpenAI `response_format` -> (serialized JSON schema, json_object); RequestError if bad."""
    if response_format is None:
        return None, False
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise RequestError("response_format.type must be 'text', 'json_object' or 'json_schema'",
                           "response_format.type")  # fmt: skip
    extra = set(response_format) - allowed[kind]
    if extra:
        raise RequestError(f"Unsupported field 'response_format.{sorted(extra)[0]}'", "response_format")
    if kind == "text":
        return None, False
    if kind == "json_object" and "schema" not in response_format:
        return None, True
    if kind == "json_object":  # llama.cpp's form: a JSON object that follows `schema`
        spec: Any = {"schema": response_format["schema"]}
        where = "response_format.schema"
    else:
        spec = response_format.get("json_schema")
        where = "response_format.json_schema.schema"
    if not isinstance(spec, dict):
        raise RequestError("response_format.json_schema must be an object with 'name' and 'schema'",
                           "response_format.json_schema")  # fmt: skip
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise RequestError(f"Unsupported field 'response_format.json_schema.{sorted(extra)[0]}'",
                           "response_format.json_schema")  # fmt: skip
    name = spec.get("name", "response")  # required by OpenAI, but it changes nothing: optional here
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise RequestError("response_format.json_schema.name must be a string of a-z, A-Z, 0-9, _ and - "
                           "(at most 64)", "response_format.json_schema.name")  # fmt: skip
    schema = spec.get("schema", {})
    problem = schema_problem(schema)
    if problem is not None:
        raise RequestError(f"{where} is not a valid JSON schema: {problem}", where)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise RequestError("response_format.json_schema.strict must be a boolean",
                           "response_format.json_schema.strict")  # fmt: skip
    return json.dumps(schema, ensure_ascii=False), False


NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a JSON schema object (checked against the 2020-12 meta-schema)."""
    if not isinstance(schema, dict):
        return "it must be a JSON object"
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message}" + (f" (at {where})" if where else "")
    return None


class CompletionRequest(_SamplingFields):
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def field_name(self, param: str) -> str:
        return "logprobs" if param == "prompt_logprobs" else param

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        normalize_prompts(v)  # raises ValueError with a precise message
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
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
    min_new_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None


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

    _sampling: SamplingParams = PrivateAttr()

    @model_validator(mode="after")
    def _build_sampling(self) -> GenerateRequest:
        sp = self.sampling_params
        fields = dict(
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            max_tokens=sp.max_new_tokens, ignore_eos=sp.ignore_eos, seed=sp.seed,
            stop_token_ids=list(sp.stop_token_ids or []), min_tokens=sp.min_new_tokens,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, json_schema=sp.json_schema, regex=sp.regex,
            stop=[] if sp.stop is None else [sp.stop] if isinstance(sp.stop, str) else list(sp.stop),
        )  # fmt: skip
        self._sampling = checked_sampling(fields, _native_name)
        return self

    def sampling(self) -> SamplingParams:
        """The validated SamplingParams (max_new_tokens is always a real limit here)."""
        return self._sampling

    def stop_list(self) -> list[str]:
        return list(self._sampling.stop)


def _native_name(param: str) -> str:
    """The /generate body's name for a SamplingParams field."""
    names = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    return f"sampling_params.{names.get(param, param)}"


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
