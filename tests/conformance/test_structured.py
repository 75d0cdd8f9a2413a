"""Structured output the way llama.cpp's and vLLM's suites ask for it: response_format text,
json_object (with llama.cpp's optional `schema`), json_schema (name optional), regex."""

from __future__ import annotations

import json

from tests.e2e.service import parallel, post_json

MSGS = [{"role": "system", "content": "You are a coding assistant."}, {"role": "user", "content": "Write an example"}]


CONSTANTS = [
    ({"type": "json_object", "schema": {"const": "42"}}, '"42"'),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, '"foooooo"'),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [7]}, "strict": True}}, "7"),
]  # fmt: skip


def test_constant_schemas(server):
    """llama.cpp's test_completion_with_response_format cases whose output the schema fixes, on
    chat and completions (all six at once)."""
    calls = []
    for response_format, _ in CONSTANTS:
        calls.append(lambda f=response_format: post_json(server.port, "/v1/chat/completions",
                                                         {"messages": MSGS, "max_tokens": 10, "response_format": f}))
        calls.append(lambda f=response_format: post_json(
            server.port, "/v1/completions", {"prompt": "Example:", "max_tokens": 10, "response_format": f}))
    results = parallel(*calls)
    for i, (_, expected) in enumerate(CONSTANTS):
        (s1, chat), (s2, cmpl) = results[2 * i], results[2 * i + 1]
        assert s1 == 200 and chat["choices"][0]["message"]["content"] == expected, chat
        assert s2 == 200 and cmpl["choices"][0]["text"] == expected, cmpl
        assert chat["choices"][0]["finish_reason"] == "stop"


def test_json_object_is_an_object(server):
    status, r = post_json(server.port, "/v1/chat/completions",
                          {"messages": MSGS, "max_tokens": 4, "response_format": {"type": "json_object"}})
    text = r["choices"][0]["message"]["content"]
    assert status == 200 and text.startswith("{")
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_text_format_and_regex(server):
    (s1, plain), (s2, rx) = parallel(
        lambda: post_json(server.port, "/v1/chat/completions",
                          {"messages": MSGS, "max_tokens": 2, "response_format": {"type": "text"}}),
        lambda: post_json(server.port, "/v1/chat/completions",
                          {"messages": MSGS, "max_tokens": 8, "regex": "(yes|no)"}))
    assert s1 == 200 and s2 == 200 and rx["choices"][0]["message"]["content"] in ("yes", "no")
