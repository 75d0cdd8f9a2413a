"""OpenAI's Responses API driven by the official `openai` SDK (`client.responses`), against the real
server on CPU (the shared keyed server, tests/e2e/conftest.py: `--api-key` and a store of 3 responses): string and item
input, instructions, stream and not (the same greedy text, the events in order), a function-call
round trip, previous_response_id, store false, GET / DELETE, the LRU bound, text.format
json_schema, usage, auth and errors in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.service import API_KEY, Server, parallel, request

openai = pytest.importorskip("openai")

KEY = API_KEY
GREEDY: dict[str, Any] = {"temperature": 0}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}]  # fmt: skip


@pytest.fixture(scope="module")
def server(keyed_server: Server) -> Server:
    return keyed_server


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=180)


def test_create_string_input_with_instructions_and_usage(client):
    plain, told = parallel(
        lambda: client.responses.create(model="m", input="Say hello.", max_output_tokens=6, **GREEDY),
        lambda: client.responses.create(model="m", input="Say hello.", instructions="Answer in French.",
                                        max_output_tokens=6, **GREEDY),
    )  # fmt: skip
    for r in (plain, told):
        assert r.id.startswith("resp_") and r.object == "response" and r.model == "m"
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        (item,) = r.output
        assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
        assert item.content[0].type == "output_text" and r.output_text == item.content[0].text != ""
        assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The instructions replace the template's default system prompt.
    assert told.instructions == "Answer in French." and told.usage.input_tokens != plain.usage.input_tokens
    # Item input is the same conversation as the string.
    items = client.responses.create(model="m", max_output_tokens=6, **GREEDY,
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}])  # fmt: skip
    assert items.output_text == plain.output_text and items.usage.input_tokens == plain.usage.input_tokens


def test_stream_events_and_same_text(client):
    whole = client.responses.create(model="m", input="Name a color.", max_output_tokens=8, **GREEDY)
    events = list(client.responses.create(model="m", input="Name a color.", max_output_tokens=8, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == 8


def test_function_call_round_trip(client):
    forced = {"type": "function", "name": "get_weather"}
    ask = "What is the weather in Paris?"
    args: dict[str, Any] = dict(model="m", input=ask, tools=TOOLS, tool_choice=forced, max_output_tokens=40, **GREEDY)

    def helper() -> Any:  # the SDK's stream helper folds the events into the final response
        with client.responses.stream(**args, store=False) as stream:
            return stream.get_final_response()

    r, events, final = parallel(lambda: client.responses.create(**args),
                                lambda: list(client.responses.create(**args, stream=True, store=False)), helper)  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and r.status == "completed"
    assert isinstance(json.loads(call.arguments), dict)
    # Streamed: the arguments arrive as deltas, then one done event with the whole of them.
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and done.name == "get_weather" and isinstance(json.loads(deltas), dict)
    (folded,) = final.output
    assert folded.type == "function_call" and folded.name == "get_weather" and isinstance(json.loads(folded.arguments), dict)
    # The output goes back as a function_call_output item, with the call itself, statelessly ...
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    back = [{"role": "user", "content": ask}, {"type": "function_call", "call_id": call.call_id,
            "name": call.name, "arguments": call.arguments}, output]  # fmt: skip
    # ... or after previous_response_id: the same conversation, the same prompt and reply.
    stateless, chained = parallel(
        lambda: client.responses.create(model="m", input=back, tools=TOOLS, max_output_tokens=6, store=False, **GREEDY),
        lambda: client.responses.create(model="m", previous_response_id=r.id, input=[output], tools=TOOLS,
                                        max_output_tokens=6, **GREEDY),
    )  # fmt: skip
    assert chained.previous_response_id == r.id
    assert chained.usage.input_tokens == stateless.usage.input_tokens > r.usage.input_tokens
    assert chained.output_text == stateless.output_text


def test_previous_response_id_store_false_get_delete(client, server):
    first = client.responses.create(model="m", input="My name is Ada.", instructions="Be brief.", max_output_tokens=4,
                                    **GREEDY)  # fmt: skip
    assert client.responses.retrieve(first.id).output_text == first.output_text
    again = client.responses.create(model="m", previous_response_id=first.id, input="What is my name?",
                                    max_output_tokens=4, **GREEDY)  # fmt: skip
    alone = client.responses.create(model="m", input="What is my name?", max_output_tokens=4, **GREEDY)
    assert again.usage.input_tokens > alone.usage.input_tokens
    # Not stored: nothing to retrieve or chain from.
    unstored = client.responses.create(model="m", input="Hi", store=False, max_output_tokens=2, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m", previous_response_id=unstored.id, input="x", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    # The store holds 3: the oldest ones go first.
    ids = [client.responses.create(model="m", input=f"n{i}", max_output_tokens=1).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model="m", input="Pick a color.", max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}})  # fmt: skip
    assert r.status == "completed" and r.text.format.type == "json_schema"
    reply = json.loads(r.output_text)
    assert set(reply) == {"color", "ok"} and reply["color"] in ("red", "green", "blue")


def test_auth_and_errors_in_openai_shape(client, server):
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model="m", input="Hi")
    status, _ = request(server.port, "POST", "/v1/responses", json.dumps({"input": "Hi"}).encode())
    assert status == 401  # no key at all
    bad = [
        ({"input": ""}, "input"),
        ({"input": [{"type": "image", "url": "x"}]}, "input"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "extra_body": {"bogus": 1}}, "bogus"),
    ]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", **body)
        err = info.value.body
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_missing")
    assert missing.value.body["type"] == "not_found_error"
