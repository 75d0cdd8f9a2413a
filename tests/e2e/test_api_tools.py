"""Tool calling through the official client: forced calls (named, required), a full round trip
with the tool's result, streamed tool-call deltas, Hermes-format parsing in "auto" mode, and
tool_choice "none". The embedded SmolLM2 template has no tool support, so the tools are rendered
into the system prompt (minisgl.tokenizer.chat)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.service import parallel, post_json

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def ask(client: Any, messages: list[Any], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, **kw)


def check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_named_tool_choice_forces_a_valid_call_and_round_trip(server, client):
    r = ask(client, ASK, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)
    # The client runs the tool and sends its result back; the conversation goes on.
    history = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    follow = ask(client, history, max_tokens=8)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
    # The rendered prompt holds the tools, the call and its result.
    body = {"messages": json.loads(json.dumps([*ASK, choice.message.model_dump(exclude_none=True),
                                               history[-1]])), "tools": TOOLS}  # fmt: skip
    status, tokens = post_json(server.port, "/tokenize", body)
    assert status == 200 and tokens["count"] == follow.usage.prompt_tokens
    status, text = post_json(server.port, "/detokenize", {"tokens": tokens["tokens"]})
    prompt = text["prompt"]
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    rendered = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)})
    assert "<tool_call>\n" + rendered + "\n</tool_call>" in prompt
    assert "<tool_response>\n22 degrees and sunny\n</tool_response>" in prompt


def test_named_tool_call_streams_argument_deltas(client):
    full, chunks = parallel(lambda: ask(client, ASK, tool_choice=NAMED).choices[0].message.tool_calls[0],
                            lambda: list(ask(client, ASK, tool_choice=NAMED, stream=True)))  # fmt: skip
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 1  # arguments arrive as they are generated
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == full.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice(client):
    # One call at most (a list of calls lets the small model repeat the call until max_tokens).
    r = ask(client, [{"role": "user", "content": "Add 2 and 3."}], tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in SCHEMAS
    check_call(call)


# The model's own format in "auto" mode, forced with the regex extension so the small model emits it.
HERMES = (r'Checking\. <tool_call>\n\{"name": "get_weather", '
          r'"arguments": \{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>')


def test_auto_mode_parses_hermes_calls(client):
    r, chunks = parallel(lambda: ask(client, ASK, extra_body={"regex": HERMES}),
                         lambda: list(ask(client, ASK, extra_body={"regex": HERMES}, stream=True)))  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and check_call(call) == {"city": "Paris", "unit": "celsius"}
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking. " and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_mode_plain_answer_and_none(client):
    hello = [{"role": "user", "content": "Say hello."}]
    auto, none = parallel(lambda: ask(client, hello, max_tokens=8),
                          lambda: ask(client, hello, max_tokens=8, tool_choice="none"))  # fmt: skip
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens  # "none": tools are not in the prompt


def test_tool_errors_are_400(server):
    bad = [
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
        {"messages": [{"role": "tool", "content": "x"}]},
    ]
    for extra in bad:
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 3, **extra}
        status, data = post_json(server.port, "/v1/chat/completions", body)
        assert status == 400, (extra, data)
        assert data["error"]["param"].split(".")[0] in ("tool_choice", "tools", "messages"), data
