"""Tools: nested parameter schemas ($defs/$ref) under every tool_choice, stream and not; forced
calls cut short by max_tokens (vLLM: finish "length", no tool_calls); tool_choice errors."""

from __future__ import annotations

import json

import pytest

from tests.conformance.conftest import error_of, stream_events
from tests.e2e.service import parallel

PATH = "/v1/chat/completions"
PARAMS = {
    "type": "object",
    "properties": {"options": {"$ref": "#/$defs/Options"}},
    "required": ["options"],
    "additionalProperties": False,
    "$defs": {
        "Options": {"type": "object", "additionalProperties": False, "required": ["unit"],
                    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    },
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid(arguments: str) -> bool:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(PARAMS).is_valid(json.loads(arguments))


def streamed_calls(events: list[dict]) -> tuple[list[dict], str | None]:
    calls: list[dict] = []
    finish = None
    for e in events:
        choice = e["choices"][0]
        assert choice["delta"].get("content") in (None, "")
        for call in choice["delta"].get("tool_calls", []):
            if "id" in call:
                calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            else:
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return calls, finish


def test_forced_call_with_defs(server, client):
    """vLLM's test_function_tool_use / test_named_tool_use with its $defs schema: required and
    named, streamed and not (all four at once); the arguments follow the schema, and the streamed
    argument deltas join into the whole arguments."""
    def body(tool_choice):
        return {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 32, "temperature": 0,
                "parallel_tool_calls": False}  # fmt: skip

    results = parallel(*[fn for choice in ("required", NAMED) for fn in (
        lambda c=choice: client.chat.completions.create(model="m", **body(c)),
        lambda c=choice: stream_events(server, PATH, body(c)))])  # fmt: skip
    for tool_choice, r, events in [("required", *results[:2]), (NAMED, *results[2:])]:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if tool_choice == NAMED:
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            assert valid(call.function.arguments), call.function.arguments
        calls, finish = streamed_calls(events)
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments


def test_forced_call_cut_by_max_tokens(server, client):
    """vLLM's test_max_tokens_with_tool_choice_required: finish "length", no tool call, no content."""
    def body(tool_choice):
        return {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_completion_tokens": 1}

    full_req, full_named, stream_req, stream_named = parallel(
        lambda: client.chat.completions.create(model="m", **body("required")),
        lambda: client.chat.completions.create(model="m", **body(NAMED)),
        lambda: stream_events(server, PATH, body("required")),
        lambda: stream_events(server, PATH, body(NAMED)))
    for r in (full_req, full_named):
        choice = r.choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content
    for events in (stream_req, stream_named):
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(not e["choices"][0]["delta"].get("content") for e in events)
    assert all("tool_calls" not in e["choices"][0]["delta"] for e in stream_req)  # nothing whole to send


def test_tool_choice_none_and_auto(client):
    none, auto = parallel(
        lambda: client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1),
        lambda: client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1))
    assert none.choices[0].message.tool_calls is None and none.usage.prompt_tokens < auto.usage.prompt_tokens


def test_tool_history_round_trip(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]  # fmt: skip
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("fields", [
    {"tool_choice": {"type": "function", "function": {"name": "nondefined"}}, "tools": TOOLS},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": {}, "tools": TOOLS},
    {"tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "hiccup"}}}]},
    {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
])  # fmt: skip
def test_inconsistent_tool_choice_and_tools(server, fields):
    status, err = error_of(server, PATH, {"messages": ASK, "max_tokens": 1, **fields})
    assert status == 400 and err["param"] in ("tool_choice", "tools") or (err["param"] or "").startswith("tools"), err
