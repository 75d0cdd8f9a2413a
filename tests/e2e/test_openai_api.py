"""The OpenAI endpoints against the offline engine's greedy outputs, with the official client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from minisgl.core import SamplingParams
from tests.e2e.service import get_json, post_json, sse_lines, wait_idle

CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]
N = 12


def greedy(max_tokens: int = N, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def chat_ref(served_offline: Any) -> dict[str, Any]:
    return served_offline.chat(CHAT, greedy(), use_tqdm=False)[0]


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert models.data[0].object == "model"
    status, health = get_json(server.port, "/health")
    assert status == 200 and health["status"] == "ok"
    assert set(health["children"]) == {"scheduler-0", "tokenizer", "detokenizer"}


def test_chat_non_stream_matches_offline(client, chat_ref):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and isinstance(r.created, int)
    assert r.model == "m"
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == chat_ref.outputs[0].text
    assert choice.finish_reason == ("length" if chat_ref.outputs[0].finish_reason == "length" else "stop")
    u = r.usage
    assert u.prompt_tokens == len(chat_ref.prompt_token_ids)
    assert u.completion_tokens == len(chat_ref.outputs[0].token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_offline(server, client, chat_ref):
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=N, temperature=0, stream=True)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == chat_ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # The raw stream: `data: {json}` events, a finish_reason, then `data: [DONE]`.
    lines = sse_lines(server.port, "/v1/chat/completions",
                      {"model": "m", "messages": CHAT, "max_tokens": N, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(chat_ref.outputs[0].token_ids)
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_content_parts_same_as_string(client, chat_ref):
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    r = client.chat.completions.create(model="m", messages=parts, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == chat_ref.outputs[0].text


def test_second_identical_request_hits_prefix_cache(client):
    msgs = [{"role": "user", "content": "Tell me about the sea and the sky, briefly."}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_completion_string(client, served_offline):
    ref = served_offline.generate("The capital of France is", greedy(8), use_tqdm=False)[0]
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_completion_batch_and_token_ids(client, served_offline):
    prompts = ["One, two, three,", "The sky is", "def add(a, b):"]
    refs = served_offline.generate(prompts, greedy(6), use_tqdm=False)
    r = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [x.outputs[0].text for x in refs]
    assert r.usage.prompt_tokens == sum(len(x.prompt_token_ids) for x in refs)
    assert r.usage.completion_tokens == sum(len(x.outputs[0].token_ids) for x in refs)
    ids = [served_offline.encode(p) for p in prompts[:2]]
    one = client.completions.create(model="m", prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == refs[0].outputs[0].text
    two = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in two.choices] == [x.outputs[0].text for x in refs[:2]]


def test_completion_stream(server, served_offline):
    ref = served_offline.generate("Once upon a time", greedy(8), use_tqdm=False)[0]
    lines = sse_lines(server.port, "/v1/completions",
                      {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True})  # fmt: skip
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == ref.outputs[0].text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_gives_length(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_string_cuts_output(client, chat_ref):
    words = chat_ref.outputs[0].text.split()
    assert len(words) >= 3, chat_ref
    stop = words[2]
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].message.content == chat_ref.outputs[0].text[: chat_ref.outputs[0].text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_n_choices_and_sampling_fields(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0.8, top_p=0.9,
                                       seed=7, n=2, extra_body={"top_k": 20, "min_p": 0.05})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 8


def test_native_generate(server, served_offline):
    ref = served_offline.generate("Hello, my name is", greedy(5), use_tqdm=False)[0]
    status, body = post_json(server.port, "/generate",
                             {"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert status == 200, body
    assert body["text"] == ref.outputs[0].text and body["output_ids"] == ref.outputs[0].token_ids
    assert body["meta_info"]["finish_reason"] in ("stop", "length")


def test_32_concurrent_requests_each_get_their_own_answer(server, client, served_offline):
    prompts = [f"Write the number {i} in words, then say one fact about it." for i in range(32)]
    convs = [[{"role": "user", "content": p}] for p in prompts]
    refs = served_offline.chat(convs, greedy(8), use_tqdm=False)

    def ask(conv: list[dict[str, str]]) -> str:
        r = client.chat.completions.create(model="m", messages=conv, max_tokens=8, temperature=0)
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, convs))
    assert answers == [r.outputs[0].text for r in refs]
    wait_idle(server.port)
