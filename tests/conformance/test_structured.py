"""Structured output the way llama.cpp's and vLLM's suites ask for it: response_format text,
json_object (with llama.cpp's optional `schema`), json_schema (name optional), regex."""

from __future__ import annotations

import json

import pytest

from tests.e2e.service import parallel, post_json

MSGS = [{"role": "system", "content": "You are a coding assistant."}, {"role": "user", "content": "Write an example"}]


@pytest.mark.parametrize("response_format, expected", [
    ({"type": "json_object", "schema": {"const": "42"}}, '"42"'),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, '"foooooo"'),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [7]}, "strict": True}}, "7"),
])  # fmt: skip
def test_constant_schemas(server, response_format, expected):
    chat, cmpl = parallel(
        lambda: post_json(server.port, "/v1/chat/completions",
                          {"messages": MSGS, "max_tokens": 10, "response_format": response_format}),
        lambda: post_json(server.port, "/v1/completions",
                          {"prompt": "Example:", "max_tokens": 10, "response_format": response_format}))  # fmt: skip
    assert chat[0] == 200 and chat[1]["choices"][0]["message"]["content"] == expected, chat
    assert cmpl[0] == 200 and cmpl[1]["choices"][0]["text"] == expected, cmpl
    assert chat[1]["choices"][0]["finish_reason"] == "stop"


def test_json_object_is_an_object(server):
    status, r = post_json(server.port, "/v1/chat/completions",
                          {"messages": MSGS, "max_tokens": 12, "response_format": {"type": "json_object"}})
    text = r["choices"][0]["message"]["content"]
    assert status == 200 and text.startswith("{")
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_text_format_and_regex(server):
    (s1, plain), (s2, rx) = parallel(
        lambda: post_json(server.port, "/v1/chat/completions",
                          {"messages": MSGS, "max_tokens": 2, "response_format": {"type": "text"}}),
        lambda: post_json(server.port, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "regex": "(yes|no)"}))
    assert s1 == 200 and s2 == 200 and rx["choices"][0]["message"]["content"] in ("yes", "no")
