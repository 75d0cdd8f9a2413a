"""Reasoning output (--reasoning-parser) end to end, on the real server on CPU.

A tiny Qwen3 whose template opens `<think>` in the prompt (tests/reasoning_model.py) serves with
`--reasoning-parser qwen3`: each front end's split (chat `reasoning_content` whole and streamed,
Anthropic `thinking` blocks, Responses `reasoning` items, the offline `LLM`) is checked against the
raw reply of the same prompt ids on /v1/completions, which no parser touches. Also
`enable_thinking: false`, and a stop string at the closing tag (no tag leaks). The embedded
model serves with `--reasoning-parser deepseek_r1`, whose replies start as thinking."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.service import Server, post_json, start_server
from tests.reasoning_model import make_thinking_model

openai = pytest.importorskip("openai")

MAX = 24
CLOSE = "</think>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_thinking_model(tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "reasoning", "--model", str(model_dir), "--reasoning-parser", "qwen3")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=180)


def raw_reply(server: Server, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """The unsplit greedy reply to the chat prompt: its ids through /v1/completions."""
    status, tokens = post_json(server.port, "/tokenize", {"messages": messages, **kwargs})
    assert status == 200, tokens
    status, body = post_json(server.port, "/v1/completions", {"prompt": tokens["tokens"], "max_tokens": MAX,
                                                              "temperature": 0})  # fmt: skip
    assert status == 200, body
    return body["choices"][0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def case(server: Server) -> tuple[list[dict[str, Any]], str, str]:
    """A conversation whose greedy reply closes the thinking with text on both sides, and the
    expected (reasoning, content) split of that reply."""
    for i in range(5, 60):
        messages = [{"role": "user", "content": f"w{i} w{i + 1}"}]
        choice = raw_reply(server, messages)
        head, sep, tail = choice["text"].partition(CLOSE)
        if sep and head.strip() and tail.strip() and choice["finish_reason"] == "length":
            return messages, head.strip("\n"), tail.lstrip()
    raise AssertionError("no prompt of the tiny model closes its thinking")


def test_chat_split_whole_and_streamed(client, case):
    messages, reasoning, content = case
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX, temperature=0)
    message = r.choices[0].message
    assert message.reasoning_content == reasoning and message.reasoning == reasoning  # vLLM's names, old and new
    assert message.content == content and CLOSE not in message.content
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=MAX, temperature=0,
                                                 stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    first = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(getattr(d, "reasoning_content", None) for d in deltas[first:])  # thinking first, then the answer


def test_enable_thinking_false_is_all_answer(client, server, case):
    messages = case[0]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = raw_reply(server, messages, **kwargs)["text"]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX, temperature=0, extra_body=kwargs)
    message = r.choices[0].message
    assert not raw.lstrip().startswith("<think>")  # (a reply that opened thinking itself would be split)
    assert getattr(message, "reasoning_content", None) is None and message.content == raw


def test_stop_string_at_the_closing_tag_leaks_no_tag(client, case):
    messages, reasoning, _ = case
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX, temperature=0, stop=[CLOSE])
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == reasoning.rstrip("\n")
    assert not choice.message.content


def test_constrained_reply_is_not_split(client, case):
    # The grammar holds from the first token: the reply is the answer even though the prompt opened <think>.
    r = client.chat.completions.create(model="m", messages=case[0], max_tokens=MAX, temperature=0,
                                       extra_body={"regex": "w1[0-9]"})  # fmt: skip
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content is not None and re.fullmatch("w1[0-9]", message.content.strip())


def test_anthropic_thinking_blocks(server, case):
    anthropic = pytest.importorskip("anthropic")
    messages, reasoning, content = case
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=180)
    args: dict[str, Any] = dict(model="m", max_tokens=MAX, messages=messages, extra_body={"temperature": 0},
                                thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    r = client.messages.create(**args)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == reasoning and r.content[1].text == content
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] \
        == [("thinking", reasoning), ("text", content)]
    # Thinking blocks of a past turn are accepted (and not shown to the model again).
    past = [*messages, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": ""},
                                                         {"type": "text", "text": "w5"}]},
            {"role": "user", "content": "w6"}]  # fmt: skip
    assert client.messages.create(**{**args, "messages": past}).content


def test_responses_reasoning_item(client, case):
    messages, reasoning, content = case
    r = client.responses.create(model="m", input=messages[0]["content"], max_output_tokens=MAX, temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning and r.output_text == content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(model="m", input=messages[0]["content"], max_output_tokens=MAX,
                                          temperature=0, stream=True))  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning


def test_offline_llm_splits_the_same(model_dir, case):
    from minisgl import LLM
    from minisgl.core import SamplingParams

    messages, reasoning, content = case
    llm = LLM(str(model_dir), device="cpu", dtype="float32", reasoning_parser="qwen3")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX), use_tqdm=False)[0].outputs[0]
    assert (out.reasoning_content, out.text) == (reasoning, content)
    plain = llm.generate(llm.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=MAX),
                         use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert plain.reasoning_content is None and CLOSE in plain.text  # only chat replies are split
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        LLM(str(model_dir), device="cpu", reasoning_parser="bogus")


def test_embedded_model_with_deepseek_r1(tmp_path_factory):
    srv = start_server(tmp_path_factory, "reasoning-r1", "--reasoning-parser", "deepseek_r1")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0, timeout=180)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        raw = raw_reply(srv, messages)["text"]
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX, temperature=0)
        message = r.choices[0].message
        assert CLOSE not in raw  # SmolLM2 does not think: its whole reply is (unclosed) thinking
        assert message.reasoning_content == raw.strip("\n") and not message.content
        off = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX, temperature=0,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
        assert off.choices[0].message.content == raw and getattr(off.choices[0].message, "reasoning_content", None) is None
    finally:
        srv.stop()
