"""Chat completions: response and chunk shapes, n with streaming, usage in every mode, logprobs,
and vLLM's leniency on messages (unknown fields ignored, custom roles handed to the template)."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import error_of, stream_events
from tests.e2e.service import parallel, post_json

CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
PATH = "/v1/chat/completions"


def test_non_stream_shape(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.created > 0
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 4
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_stream_matches_non_stream_and_openai_chunk_shape(server, client):
    body = {"model": "m", "messages": CHAT, "max_tokens": 3, "temperature": 0}
    full, events = parallel(lambda: client.chat.completions.create(**body), lambda: stream_events(server, PATH, body))
    assert len({e["id"] for e in events}) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
    first = events[0]["choices"]
    assert first == [{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                      "finish_reason": None}]  # fmt: skip
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    finishes = [e for e in events if e["choices"][0]["finish_reason"] is not None]
    assert finishes == [events[-1]] and events[-1]["choices"][0]["delta"] == {}  # alone, as OpenAI sends it
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == full.choices[0].message.content
    assert events[-1]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    assert all("usage" not in e for e in events)  # no usage unless asked


def test_stream_include_usage(server, client):
    body = {"model": "m", "messages": CHAT, "max_tokens": 2, "temperature": 0}
    full, events, chunks = parallel(
        lambda: client.chat.completions.create(**body),
        lambda: stream_events(server, PATH, {**body, "stream_options": {"include_usage": True}}),
        lambda: list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})))
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == full.usage.completion_tokens
    assert usage["prompt_tokens"] == full.usage.prompt_tokens and usage["total_tokens"] == full.usage.total_tokens
    assert all("usage" not in e for e in events[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_stream_each_choice_starts_with_its_role(server):
    opts = {"stream_options": {"include_usage": True}}
    events, single = parallel(
        lambda: stream_events(server, PATH, {"messages": CHAT, "max_tokens": 2, "n": 2, "ignore_eos": True, **opts}),
        lambda: stream_events(server, PATH, {"messages": CHAT, "max_tokens": 1, **opts}))
    seen: dict[int, list[dict]] = {0: [], 1: []}
    for e in events[:-1]:
        assert len(e["choices"]) == 1  # one choice per chunk, as OpenAI sends them
        seen[e["choices"][0]["index"]].append(e["choices"][0])
    for chunks in seen.values():
        assert chunks[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in chunks[1:])
        assert [c["finish_reason"] is not None for c in chunks].count(True) == 1 and chunks[-1]["finish_reason"]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == single[-1]["usage"]["prompt_tokens"]  # the shared prompt counted once
    assert usage["completion_tokens"] == 4


def test_n2_non_stream(client):
    r, one = parallel(lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, n=2, seed=1,
                                                             extra_body={"ignore_eos": True}),
                      lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=1))  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 4


def test_logprobs_non_stream(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode(errors="replace") == t.token and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob


def test_logprobs_stream_llama_cpp_shape(client):
    """llama.cpp's test_logprobs_stream: the role chunk has no content; every content chunk carries
    logprobs whose tokens spell its text."""
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True)  # fmt: skip
    text, spelled = "", ""
    for i, chunk in enumerate(stream):
        choice = chunk.choices[0]
        if i == 0:
            assert choice.delta.content is None and choice.delta.role == "assistant"
            continue
        assert choice.delta.role is None
        if choice.finish_reason is None:
            text += choice.delta.content or ""
            assert choice.logprobs is not None and choice.logprobs.content
            for t in choice.logprobs.content:
                spelled += t.token
                assert t.logprob <= 0 and t.bytes is not None and len(t.top_logprobs) == 2
    assert text and spelled == text


def test_top_logprobs_zero_and_logprobs_off(client):
    r, off = parallel(
        lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=1, logprobs=True, top_logprobs=0),
        lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=1, logprobs=False))
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content) and off.choices[0].logprobs is None


def test_unknown_message_fields_are_ignored(client):
    """vLLM's test_extra_content_fields: fields a message does not define do not matter."""
    extra = [{**m, "extra_field": "x", "metadata": {"k": 1}} for m in CHAT]
    plain, r = parallel(lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, temperature=0),
                        lambda: client.chat.completions.create(model="m", messages=extra, max_tokens=2, temperature=0))
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_custom_role_reaches_the_template(server):
    base = [{"role": "user", "content": "hi"}]
    custom = [{"role": "narrator", "content": "Once upon a time"}, *base]
    status, plain = post_json(server.port, "/tokenize", {"messages": base})
    assert status == 200
    status, both = post_json(server.port, "/v1/chat/completions", {"messages": custom, "max_tokens": 1})
    assert status == 200, both
    assert both["usage"]["prompt_tokens"] > plain["count"]  # the custom turn is in the prompt


def test_content_parts_and_developer_role(client):
    parts = [{"role": "developer", "content": "Book"},
             {"role": "user", "content": [{"type": "text", "text": "What is the best book"}]}]  # fmt: skip
    plain, r = parallel(lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, temperature=0),
                        lambda: client.chat.completions.create(model="m", messages=parts, max_tokens=2, temperature=0))
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens and r.choices[0].message.content == \
        plain.choices[0].message.content  # fmt: skip


def test_assistant_prefill_is_continued(client):
    r = client.chat.completions.create(model="m", messages=[*CHAT, {"role": "assistant", "content": "The"}],
                                       max_tokens=1)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("messages", [
    None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
    [{"role": "system", "content": "test"}, {}],
    [{"role": "user", "content": "test"}, {"role": "assistant", "content": "test"},
     {"role": "assistant", "content": "test"}],
    [], [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "tool", "content": "x"}],
])  # fmt: skip
def test_invalid_message_lists_llama_cpp(server, messages):
    status, err = error_of(server, PATH, {"messages": messages, "max_tokens": 1})
    assert status == 400 and (err["param"] or "").startswith("messages"), err


def test_model_field_echoed_and_models_route(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    r = client.chat.completions.create(model=models[0].id, messages=CHAT, max_tokens=1)
    assert r.model == models[0].id
