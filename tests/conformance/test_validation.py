"""Validation errors: a 400 in OpenAI's error shape that names the field, for bad values, values
past the documented limits (docs/openai_api.md) and values outside the API's types."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import error_of
from tests.e2e.service import post_json, request

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields, param", [
    ({"n": 10**9}, "n"),
    ({"n": 0}, "n"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"stop": [f"s{i}" for i in range(5000)]}, "stop"),
    ({"stop": "x" * 5000}, "stop"),
    ({"stop_token_ids": list(range(5000))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(5000)}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"response_format": {"type": "sound"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {"type": 123}}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {"type": "hiccup"}}}, "response_format"),
])  # fmt: skip
@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_field_named(server, path, fields, param):
    body = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    status, err = error_of(server, path, {**body, "max_tokens": 1, **fields})
    assert status == 400 and (err["param"] or "").startswith(param), err
    assert err["type"] == "invalid_request_error"


def test_logit_bias_names_every_bad_key(server):
    status, err = error_of(server, CHAT, {"messages": MSGS, "logit_bias": {"abc": 1, "7": 1, "x": 2}})
    assert status == 400 and err["param"] == "logit_bias" and "'abc'" in err["message"] and "'x'" in err["message"]


def test_seed_edges_accepted(server):
    for seed in (-(2**63), 2**63 - 1):
        status, r = post_json(server.port, CMPL, {"prompt": "hi", "max_tokens": 1, "seed": seed, "temperature": 1})
        assert status == 200, r


@pytest.mark.parametrize("body", [b"{", b"", b"[]", b"null", b'"x"', b'{"messages": [}'])
def test_malformed_bodies(server, body):
    status, data = request(server.port, "POST", CHAT, body)
    assert status == 400 and b'"error"' in data


def test_context_overflow_is_400(server):
    status, err = error_of(server, CHAT, {"messages": MSGS * 4, "max_tokens": 100_000})
    assert status == 400 and err["param"] == "max_tokens" and "context" in err["message"]
