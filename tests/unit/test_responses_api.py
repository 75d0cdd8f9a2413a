"""Responses API pieces without a server: the body's translation into the chat request, the LRU
store, and the response object / event sequence built from text deltas."""

from __future__ import annotations

import json

import pytest

from minisgl.message.frontend import TextDelta
from minisgl.server.choice import ChoiceOptions
from minisgl.server.protocol import RequestError, parse_request
from minisgl.server.request_msgs import chat_options
from minisgl.server.responses_api import ResponseObjectBuilder
from minisgl.server.responses_protocol import ResponsesRequest, ResponseStore, input_messages


def parse(body: dict) -> ResponsesRequest:
    return parse_request(ResponsesRequest, json.dumps(body).encode())  # type: ignore[no-any-return]


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    ]  # fmt: skip
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "Weather in Paris?"
    assert messages[2]["content"] == "Let me look." and [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_to_chat_maps_every_field():
    req = parse({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5,
                 "top_p": 0.9, "parallel_tool_calls": False, "reasoning": {"effort": "low"},
                 "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                 "tool_choice": {"type": "function", "name": "f"},
                 "metadata": {"k": "v"}})  # fmt: skip
    chat = req.to_chat([{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}])
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.max_tokens == 9 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.tool_mode == "named" and chat.forced_tool == "f" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}
    fmt = {"type": "json_schema", "name": "r", "schema": {"type": "object"}, "strict": True}
    chat = parse({"input": "Hi", "text": {"format": fmt}}).to_chat([])
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"},
                                                                             "strict": True}}  # fmt: skip
    sampling, _ = chat.sampling(100)
    assert sampling.json_schema is not None


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content"),
    ({"input": "Hi", "tools": [{"type": "file_search"}]}, "tools"),
    ({"input": "Hi", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}, None),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"input": "Hi", "temperature": -1}, None),
    ({"input": "Hi", "frequency": 1}, "frequency"),
])  # fmt: skip
def test_bad_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        parse(body).to_chat([])
    assert info.value.status == 400
    if param is not None:
        assert info.value.param == param


def test_store_is_a_bounded_lru():
    from minisgl.server.responses_protocol import StoredResponse

    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, []))
    assert empty.get("x") is None


def events(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        name, data = chunk.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == "event: " + payload["type"]
        out.append(payload)
    return out


def test_builder_items_and_events():
    req = parse({"input": "Hi", "max_output_tokens": 5})
    builder = ResponseObjectBuilder(req, "m", ChoiceOptions())
    stream = events(builder.start())
    stream += events(builder.add(TextDelta(1, "", [1, 2], reasoning="think")))
    stream += events(builder.add(TextDelta(1, "Hel", [3])))
    stream += events(builder.add(TextDelta(1, "lo", [4], finish_reason="length", prompt_tokens=7, cached_tokens=2,
                                           completion_tokens=5)))  # fmt: skip
    assert [e["type"] for e in stream] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    assert stream[0]["response"]["status"] == "in_progress" and stream[0]["response"]["output"] == []
    final = stream[-1]["response"]
    assert final == builder.response()
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert final["output"][1]["content"][0]["text"] == "Hello" and final["output"][1]["status"] == "incomplete"
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 12}  # fmt: skip
    assert builder.conversation() == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_builder_function_calls():
    req = parse({"input": "Weather?", "tools": [{"type": "function", "name": "get_weather",
                                                 "parameters": {"type": "object"}}]})  # fmt: skip
    builder = ResponseObjectBuilder(req, "m", chat_options(req.to_chat([])))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = events(builder.add(TextDelta(1, call, [1], finish_reason="stop", prompt_tokens=3, completion_tokens=9)))
    kinds = [e["type"] for e in stream]
    assert kinds == ["response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (item,) = stream[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert json.loads(item["arguments"]) == {"city": "Paris"} and item["call_id"].startswith("call_")
    (history_reply,) = builder.conversation()[1:]
    assert history_reply["tool_calls"][0]["id"] == item["call_id"] and history_reply["content"] is None


def test_empty_reply_is_one_empty_message():
    builder = ResponseObjectBuilder(parse({"input": "Hi"}), "m", ChoiceOptions())
    builder.add(TextDelta(1, "", [], finish_reason="stop", prompt_tokens=3, completion_tokens=1))
    (item,) = builder.response()["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "" and builder.status == "completed"
