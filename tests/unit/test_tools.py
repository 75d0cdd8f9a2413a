"""Tool calls: parsing model output (streamed in any split), forced-call schemas, chat rendering."""

from __future__ import annotations

import json

import pytest

from minisgl.message.tokenizer import ChatPrompt
from minisgl.server.tools import (
    AutoToolParser,
    NamedToolParser,
    ParsedDelta,
    RequiredToolParser,
    parse_json_calls,
    tool_choice_schema,
)

NAMES = ["get_weather", "add"]


def run(parser, text: str, step: int) -> tuple[str, list[dict], list[str]]:
    """Feed `text` in pieces of `step` chars; (content, calls, content pieces as streamed)."""
    pieces: list[ParsedDelta] = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)]
    pieces.append(parser.finish())
    calls: list[dict] = []
    for p in pieces:
        for c in p.calls:
            if c.id is not None:
                calls.append({"name": c.name, "arguments": c.arguments, "id": c.id})
            else:
                calls[c.index]["arguments"] += c.arguments
    return "".join(p.content for p in pieces), calls, [p.content for p in pieces if p.content]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_after_text(step):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n')  # fmt: skip
    content, calls, streamed = run(AutoToolParser(NAMES), text, step)
    assert content == "Let me check.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]  # fmt: skip
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert not any("<" in piece for piece in streamed)  # markup never leaks as content


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_plain_text_passes_through_promptly(step):
    text = "The answer is 4 < 5, and <b>bold</b> stays."
    parser = AutoToolParser(NAMES)
    content, calls, streamed = run(parser, text, step)
    assert content == text and calls == [] and not parser.called
    if step == 1:
        assert len(streamed) > 10  # streamed as it comes, not held to the end


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
    '  [{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    '{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\"}"}',
])  # fmt: skip
def test_llama_json_calls(text):
    content, calls, _ = run(AutoToolParser(NAMES), text, 2)
    assert content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # JSON, but not a call
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
    "<tool_call>not json</tool_call>",
])  # fmt: skip
def test_non_calls_stay_text(text):
    content, calls, _ = run(AutoToolParser(NAMES), text, 3)
    assert content == text and calls == []


def test_unterminated_block_still_a_call_and_parallel_off():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": {}}'
    _, calls, _ = run(AutoToolParser(NAMES, parallel=False), text, 5)
    assert len(calls) == 1
    _, calls, _ = run(AutoToolParser(NAMES), text, 5)
    assert len(calls) == 2 and calls[1]["arguments"] == "{}"


def test_named_parser_streams_arguments():
    parser = NamedToolParser("add")
    first = parser.feed('{"a": ')
    assert first.calls[0].name == "add" and first.calls[0].id and first.calls[0].arguments == '{"a": '
    more = parser.feed("1}")
    assert more.calls[0].id is None and more.calls[0].index == 0 and more.calls[0].arguments == "1}"
    assert not parser.finish()


def test_required_parser_and_schema():
    schema = tool_choice_schema([{"type": "function", "function": {"name": "add"}}], None, True)
    assert schema["items"]["properties"]["parameters"] == {"type": "object", "properties": {}}
    _, calls, _ = run(RequiredToolParser(NAMES), '[{"name": "add", "parameters": {"a": 2}}]', 4)
    assert calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 2}
    content, calls, _ = run(RequiredToolParser(NAMES), '[{"name": "add", "param', 4)
    assert calls == [] and content == '[{"name": "add", "param'
    cut = '[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {}}, {"name": "ad'
    content, calls, _ = run(RequiredToolParser(NAMES), cut, 7)  # max_tokens hit: whole calls survive
    assert content == "" and [c["name"] for c in calls] == ["add", "get_weather"]
    assert parse_json_calls('{"name": "add", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
                            set(NAMES)) == [("add", "{}"), ("get_weather", "{}")]  # fmt: skip


# ---------------------------------------------------------------- chat rendering

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "22C", "tool_call_id": "call_1"},
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
TOOL_AWARE = (
    "{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m['role'] == 'tool' %}({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if thinking is defined %}thinking={{ thinking }}{% endif %}"
)


def _tokenizer(template: str):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, "x")),
                                                chat_template=template)  # fmt: skip


def test_template_without_tools_gets_them_inline():
    from minisgl.tokenizer.chat import ChatRenderer, tools_system_block

    text = ChatRenderer(_tokenizer(CHATML)).render(ChatPrompt(HISTORY, [TOOL]))
    assert text.startswith("<|im_start|>system\n" + tools_system_block([TOOL]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_with_tools_gets_them_natively_and_kwargs():
    from minisgl.tokenizer.chat import ChatRenderer

    prompt = ChatPrompt(HISTORY, [TOOL], {"thinking": False})
    text = ChatRenderer(_tokenizer(TOOL_AWARE)).render(prompt)
    assert text.startswith("TOOLS=get_weather\n")
    assert '[call get_weather {"city": "Paris"}]' in text  # arguments handed over as an object
    assert "tool:sunny(call_1)" in text and text.endswith("thinking=False")


DEFS_PARAMS = {
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    "type": "object", "properties": {"location": {"$ref": "#/$defs/Loc"}, "again": {"$ref": "#"}},
}  # fmt: skip


def test_required_schema_keeps_defs_reachable():
    tools = [{"type": "function", "function": {"name": "w", "parameters": DEFS_PARAMS}},
             {"type": "function", "function": {"name": "add"}}]  # fmt: skip
    schema = tool_choice_schema(tools, None, True)
    first = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert first == {"$ref": "#/$defs/tool_w"}
    moved = schema["$defs"]["tool_w"]
    assert moved["properties"]["location"] == {"$ref": "#/$defs/tool_w/$defs/Loc"}
    assert moved["properties"]["again"] == {"$ref": "#/$defs/tool_w"}
    assert DEFS_PARAMS["properties"]["location"] == {"$ref": "#/$defs/Loc"}  # the request is not changed
    from jsonschema import Draft202012Validator

    valid = [{"name": "w", "parameters": {"location": {"city": "Paris"}, "again": {}}}]
    Draft202012Validator(schema).validate(valid)
    assert not Draft202012Validator(schema).is_valid([{"name": "w", "parameters": {"location": {}}}])
    xgr = pytest.importorskip("xgrammar")
    xgr.Grammar.from_json_schema(json.dumps(schema))  # compiles: every reference resolves
    assert tool_choice_schema(tools, "w", True) == DEFS_PARAMS
