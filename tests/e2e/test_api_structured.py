"""Structured output through the API: response_format json_schema / json_object and the `regex`
extension; the output must parse and validate, streamed or not."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.e2e.service import parallel, post_json

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "flags": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False},
    "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
                "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
        "required": ["point", "tags"], "additionalProperties": False},
    "shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]},
    "code": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                              "count": {"type": "integer", "minimum": 1, "maximum": 5}},
             "required": ["code", "count"], "additionalProperties": False},
}  # fmt: skip
QUESTION = {"person": "Describe a person.", "flags": "Pick a color.", "numbers": "Give me some numbers.",
            "nested": "Give a point and tags.", "shape": "Describe a shape.", "code": "Give an airport code."}  # fmt: skip


def _schema_format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_json_schema_outputs_validate(client):
    def ask(name: str) -> tuple[str, Any]:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION[name]}],
                                           max_tokens=80, temperature=0, response_format=_schema_format(name))  # fmt: skip
        return name, r.choices[0]

    results = parallel(*[lambda name=name: ask(name) for name in SCHEMAS])  # one batch: faster
    for name, choice in results:
        assert choice.finish_reason == "stop", (name, choice)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_schema_streamed_and_on_completions(server, client):
    def streamed() -> str:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION["person"]}],
                                                max_tokens=80, temperature=0, stream=True,
                                                response_format=_schema_format("person"))  # fmt: skip
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    text, (status, body) = parallel(streamed, lambda: post_json(server.port, "/v1/completions", {
        "prompt": "A color:", "max_tokens": 40, "temperature": 0, "response_format": _schema_format("flags")}))  # fmt: skip
    jsonschema.validate(json.loads(text), SCHEMAS["person"])
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["text"]), SCHEMAS["flags"])


def test_json_object(client):
    msgs = [{"role": "user", "content": 'Give a JSON object with the key "answer" set to yes.'}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex(client):
    patterns = [r"(yes|no), [0-9]{2}!", r"[a-z]{3,6}@example\.(com|org)"]

    def ask(pattern: str) -> Any:
        return lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Answer."}],
                                                      max_tokens=30, temperature=0, extra_body={"regex": pattern})  # fmt: skip

    for pattern, r in zip(patterns, parallel(*map(ask, patterns))):
        assert r.choices[0].finish_reason == "stop", r
        assert re.fullmatch(pattern, r.choices[0].message.content)


def test_bad_structured_requests(server):
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         "response_format"),
        ({"regex": "(a"}, "regex"),
        ({"regex": "a+", "response_format": {"type": "json_object"}}, "regex"),
    ]  # fmt: skip
    for extra, param in cases:
        status, body = post_json(server.port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, **extra})
        assert status == 400, (extra, body)
        assert (body["error"]["param"] or "").startswith(param) or param in body["error"]["message"], body


def test_chat_template_kwargs(server, client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")
    status, body = post_json(server.port, "/v1/chat/completions",
                             {"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"
