"""Hypothesis-generated bodies against every POST route: the server never answers 5xx, never
hangs, and is healthy and idle (every page back, no reply state left) afterwards.

Bodies mix well-formed requests with any JSON in any field (huge and negative integers, NaN and
Infinity, wrong types, unknown fields), arbitrary JSON documents and raw bytes. The server runs
with a 64-token context and plausible bodies ask for at most 3 tokens, so a request that is valid
costs little.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from tests.e2e.service import Server, get_json, request, wait_idle

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = 150
ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/detokenize"]

# Any JSON value, including what json.dumps writes for NaN and infinities (NaN, Infinity).
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


small_int = st.integers(min_value=-2, max_value=6)
huge_int = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
int_any = st.one_of(small_int, st.integers(), huge_int)
number_any = st.one_of(st.floats(), small_int, st.sampled_from([1e308, -1e308, 1e-320]))
text = st.text(max_size=24)
stop = st.one_of(text, st.lists(text, max_size=4))
token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "user"]),
     "content": st.one_of(text, st.lists(part, min_size=1, max_size=2))},
)  # fmt: skip
tool = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True)},
                                       optional={"parameters": st.just({"type": "object", "properties": {}}),
                                                 "description": text})},
)  # fmt: skip
# Plausible values (mostly valid, a few tokens of output at most); `mutate` below breaks one.
sampling = {
    "max_tokens": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "n": st.integers(1, 3), "seed": st.integers(0, 2**32),
    "stop": stop, "stop_token_ids": token_ids, "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 2),
    "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "model": text,
}  # fmt: skip
optional = {k: v for k, v in sampling.items() if k != "max_tokens"}
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # route: (required, optional) fields
    "/v1/chat/completions": ({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)},
                             {**optional, "tools": st.lists(tool, max_size=2), "logprobs": st.booleans(),
                              "top_logprobs": st.integers(0, 5)}),
    "/v1/completions": ({"prompt": st.one_of(text.filter(bool), st.lists(text.filter(bool), min_size=1, max_size=3),
                                             token_ids), "max_tokens": st.integers(1, 3)},
                        {**optional, "echo": st.booleans(), "logprobs": st.integers(0, 5)}),
    "/generate": ({"text": text.filter(bool),
                   "sampling_params": st.fixed_dictionaries({"max_new_tokens": st.integers(1, 3)}, optional={
                       "temperature": st.floats(0, 2), "stop": stop, "ignore_eos": st.booleans(),
                       "top_k": st.integers(-1, 50)})},
                  {"stream": st.booleans()}),
    "/tokenize": ({"prompt": text}, {"add_special_tokens": st.booleans()}),
    "/detokenize": ({"tokens": token_ids}, {"model": text}),
}  # fmt: skip


@st.composite
def shaped(draw: Any, route: str) -> dict[str, Any]:
    """A plausible body for `route`; most of the time one field is then broken: any JSON in its
    place, an extreme number, a key dropped or an unknown one added."""
    required, optional = SHAPES[route]
    body: dict[str, Any] = draw(st.fixed_dictionaries(required, optional=optional))
    how = draw(st.sampled_from(["none", "any", "any", "number", "number", "drop", "unknown"]))
    key = draw(st.sampled_from(sorted({*required, *optional})))
    if how == "any":
        body[key] = draw(any_json)
    elif how == "number":
        body[key] = draw(st.one_of(int_any, number_any))
    elif how == "drop":
        body.pop(key, None)
    elif how == "unknown":
        body[draw(text)] = draw(any_json)
    return body


@st.composite
def route_and_body(draw: Any) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["shaped"] * 6 + ["json", "bytes"]))
    if kind == "shaped":
        return route, json.dumps(draw(shaped(route))).encode()
    if kind == "json":
        return route, json.dumps(draw(any_json)).encode()
    return route, draw(st.binary(max_size=64))


@pytest.fixture(scope="module")
def fuzz_server(small_context_server: Server) -> Server:
    return small_context_server


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
@given(case=route_and_body())
def test_no_5xx(fuzz_server: Server, case: tuple[str, bytes]) -> None:
    route, body = case
    try:
        status, data = request(fuzz_server.port, "POST", route, body, timeout=60)
    except (OSError, http.client.HTTPException) as exc:
        raise AssertionError(f"POST {route} {body[:300]!r}: no answer ({exc!r})") from None
    assert status < 500, f"POST {route} {body[:300]!r} -> {status} {data[:300]!r}"
    if status >= 400:
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"]


def test_healthy_and_idle_after(fuzz_server: Server) -> None:
    status, health = get_json(fuzz_server.port, "/health")
    assert status == 200 and health["status"] == "ok"
    wait_idle(fuzz_server.port, timeout=30)
    status, data = request(fuzz_server.port, "POST", "/v1/completions",
                           json.dumps({"model": "m", "prompt": "1, 2,", "max_tokens": 2}).encode())  # fmt: skip
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
    log = fuzz_server.log()
    assert "Traceback" not in log, log[-4000:]
