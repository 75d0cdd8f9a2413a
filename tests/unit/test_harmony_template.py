"""A harmony-style chat template (GPT-OSS's format, written here in the constructs the shipped one
uses: `strftime_now`, `raise_exception`, `namespace`, the `reasoning_effort` kwarg, tools read
from `tool.function`, an assistant's `tool_calls[0].function` with `arguments|tojson`, tool
results after it) renders through the chat path unchanged, and its own refusals become
ChatTemplateError (HTTP 400)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl.message.tokenizer import ChatPrompt
from minisgl.tokenizer.chat import ChatRenderer, ChatTemplateError

HARMONY = (
    "{{- '<|start|>system<|message|>Knowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') }}"
    "{{- '\\n\\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '<|end|>' }}"
    "{%- if messages[0].role in ('developer', 'system') %}{%- set dev = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set dev = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if dev or tools %}{{- '<|start|>developer<|message|>' + dev }}"
    "{%- for tool in tools or [] %}{{- '\\ntype ' + tool.function.name + ' = (_: ' + tool.function.parameters|tojson + ') => any;' }}"
    "{%- endfor %}{{- '<|end|>' }}{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for m in loop_messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{%- set call = m.tool_calls[0].function %}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' + call.arguments|tojson + '<|call|>' }}"
    "{%- set last.name = call.name %}"
    "{%- elif m.role == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'tool' %}{%- if last.name is none %}{{- raise_exception('tool message without a tool call') }}{%- endif %}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + m.content|tojson + '<|end|>' }}"
    "{%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> ChatRenderer:
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    path: Path = tmp_path_factory.mktemp("harmony")
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "<|return|>": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "eos_token": "<|return|>",
              "chat_template": HARMONY}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return ChatRenderer(tf.AutoTokenizer.from_pretrained(str(path)))


def test_harmony_conversation_with_tools(renderer: ChatRenderer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    text = renderer.render(ChatPrompt(messages, tools, {"reasoning_effort": "high"}))
    assert text.startswith("<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: 20")
    assert "Reasoning: high<|end|>" in text
    assert '<|start|>developer<|message|>Be brief.\ntype get_weather = (_: {"type": "object"}) => any;<|end|>' in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    # arguments arrive as the object the template serialises, not the OpenAI JSON string
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text
    assert text.endswith('to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')


def test_harmony_refusal_is_a_template_error(renderer: ChatRenderer) -> None:
    with pytest.raises(ChatTemplateError, match="tool message without a tool call"):
        renderer.render(ChatPrompt([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]))
