"""Anthropic's Messages API driven by the official `anthropic` SDK, against the real server on CPU
(the shared keyed server, tests/e2e/conftest.py): plain and streamed messages, system, multi-turn,
stop_sequences and max_tokens stop reasons, tools with a forced tool_use and a tool_result turn,
count_tokens, and errors in Anthropic's shape (400 invalid_request_error, 401 authentication_error,
404 not_found_error). Newer SDKs have no temperature argument; it goes in `extra_body`."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from tests.e2e.service import API_KEY, Server, parallel

anthropic = pytest.importorskip("anthropic")

KEY = API_KEY
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Say hello to the world."}]
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(keyed_server: Server) -> Server:
    return keyed_server


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=180)


def post(server: Server, path: str, body: Any, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_create_with_system_and_max_tokens(client):
    plain, system = parallel(
        lambda: client.messages.create(model="m", max_tokens=6, messages=HELLO, extra_body=GREEDY),
        lambda: client.messages.create(model="m", max_tokens=6, messages=HELLO, system="Answer in French.",
                                       extra_body=GREEDY),
    )  # fmt: skip
    for r in (plain, system):
        assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "m"
        (block,) = r.content
        assert block.type == "text" and block.text
        assert r.stop_reason == "max_tokens" and r.stop_sequence is None
        assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    # The system prompt replaces the template's default one and changes the answer.
    assert system.content[0].text != plain.content[0].text
    assert client.messages.count_tokens(model="m", messages=HELLO, system="Answer in French.").input_tokens \
        == system.usage.input_tokens
    # System as text blocks is the same prompt as the string.
    blocks = client.messages.create(model="m", max_tokens=6, messages=HELLO, extra_body=GREEDY,
                                    system=[{"type": "text", "text": "Answer in "}, {"type": "text", "text": "French."}])  # fmt: skip
    assert blocks.usage.input_tokens == system.usage.input_tokens and blocks.content[0].text == system.content[0].text


def test_multi_turn_and_count_tokens(client):
    history = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Hello, world!"}]},
               {"role": "user", "content": [{"type": "text", "text": "Now say it louder."}]}]  # fmt: skip
    r = client.messages.create(model="m", max_tokens=4, messages=history, system="Be brief.", extra_body=GREEDY)
    assert r.content[0].text and r.stop_reason in ("max_tokens", "end_turn")
    first = client.messages.create(model="m", max_tokens=4, messages=HELLO, system="Be brief.", extra_body=GREEDY)
    assert r.usage.input_tokens > first.usage.input_tokens
    # count_tokens applies the chat template as /v1/messages does: the same count as its usage.
    counted = client.messages.count_tokens(model="m", messages=history, system="Be brief.")
    assert counted.input_tokens == r.usage.input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > client.messages.count_tokens(model="m", messages=ASK).input_tokens


def test_stop_sequences(client):
    free = client.messages.create(model="m", max_tokens=12, messages=HELLO, extra_body=GREEDY)
    text = free.content[0].text
    stop = next(ch for ch in text[1:] if ch.isalpha())  # a letter after the first one
    r = client.messages.create(model="m", max_tokens=12, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop, 1)]


def test_stream_equals_create(client, server):
    def streamed() -> tuple[str, Any]:
        with client.messages.stream(model="m", max_tokens=10, messages=HELLO, extra_body=GREEDY) as stream:
            return "".join(stream.text_stream), stream.get_final_message()

    full, (text, final) = parallel(
        lambda: client.messages.create(model="m", max_tokens=10, messages=HELLO, extra_body=GREEDY), streamed)
    assert text == full.content[0].text and text
    assert final.stop_reason == full.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10 and final.usage.input_tokens == full.usage.input_tokens
    # The raw events, in Anthropic's order, each framed as `event: <type>` + `data: {"type": <type>}`.
    status, raw = post(server, "/v1/messages", {"model": "m", "max_tokens": 4, "messages": HELLO, "stream": True,
                                                **GREEDY}, {"x-api-key": KEY})  # fmt: skip
    assert status == 200
    events = [chunk.split("\n") for chunk in raw.decode().strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    for lines, name in zip(events, names):
        assert lines[0].startswith("event: ") and json.loads(lines[1].removeprefix("data: "))["type"] == name
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = json.loads(events[0][1].removeprefix("data: "))["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["usage"]["input_tokens"] > 0


def test_forced_tool_use_streams_input_json_and_takes_a_tool_result(client):
    def streamed() -> tuple[list[Any], Any]:
        with client.messages.stream(model="m", max_tokens=24, messages=ASK, tools=TOOLS, tool_choice=FORCED,
                                    extra_body=GREEDY) as stream:  # fmt: skip
            return list(stream), stream.get_final_message()

    r, (events, final) = parallel(
        lambda: client.messages.create(model="m", max_tokens=24, messages=ASK, tools=TOOLS, tool_choice=FORCED,
                                       extra_body=GREEDY),
        streamed,
    )  # fmt: skip
    assert r.stop_reason == "tool_use"
    (call,) = r.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]  # fmt: skip
    assert len(partial) > 1 and json.loads("".join(partial)) == call.input
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name) for b in starts] == [("tool_use", "get_weather")]
    assert final.stop_reason == "tool_use" and final.content[0].input == call.input
    # The client runs the tool and answers with a tool_result block; the conversation goes on.
    history = [*ASK, {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "22 degrees and sunny"}]}]}]  # fmt: skip
    follow = client.messages.create(model="m", max_tokens=5, messages=history, tools=TOOLS, extra_body=GREEDY)
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content
    assert follow.usage.input_tokens > r.usage.input_tokens
    none = client.messages.count_tokens(model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "none"})
    assert none.input_tokens == client.messages.count_tokens(model="m", messages=ASK).input_tokens


def test_errors_in_anthropic_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", messages=HELLO, max_tokens=0)
    assert bad.value.status_code == 400 and bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    # The SDK will not send a body without max_tokens; a raw request does.
    status, raw = post(server, "/v1/messages", {"model": "m", "messages": HELLO}, {"x-api-key": KEY})
    body = json.loads(raw)
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    for bad_body in (b"{not json", {"model": "m", "max_tokens": 3, "messages": []},
                     {"model": "m", "max_tokens": 3, "messages": [{"role": "system", "content": "x"}]},
                     {"model": "m", "max_tokens": 3, "messages": ASK, "tool_choice": {"type": "any"}},
                     {"model": "m", "max_tokens": 3, "messages": ASK, "tools": TOOLS,
                      "tool_choice": {"type": "tool", "name": "nope"}},
                     {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "image"}]}]}):  # fmt: skip
        status, raw = post(server, "/v1/messages", bad_body, {"x-api-key": KEY})
        assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error", raw
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="m", max_tokens=2, messages=HELLO)
    assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model="m", messages=HELLO)
    status, _ = post(server, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": HELLO},
                     {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert status == 200  # a Bearer token works too
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.get("/v1/messages/nope", cast_to=object)
    assert missing.value.body["error"]["type"] == "not_found_error"
