"""Sampling controls through the OpenAI API, checked by their documented effect: penalties,
logit_bias, min_tokens, seed, stop strings / stop token ids (with stop_reason and
include_stop_str_in_output), logprobs for chat and completions, echo, stream usage."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.e2e.service import parallel, post_json, sse_lines

CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROMPT = "The capital of France is Paris. The capital of Germany is"


def token_text(port: int, token: int) -> str:
    status, body = post_json(port, "/detokenize", {"tokens": [token]})
    assert status == 200, body
    return body["prompt"]


def complete(client: Any, **kw: Any) -> Any:
    return client.completions.create(model="m", prompt=kw.pop("prompt", PROMPT), temperature=0, **kw)


@pytest.fixture(scope="module")
def ref(server) -> tuple[list[int], list[str]]:
    """The greedy continuation of PROMPT: token ids and each token's text."""
    status, body = post_json(server.port, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert status == 200, body
    return body["output_ids"], [token_text(server.port, t) for t in body["output_ids"]]


# ---------------------------------------------------------------- logit_bias, penalties, min_tokens, seed


def test_logit_bias(server, client, ref):
    target = 19556  # any ordinary token
    ids, texts = ref
    plus, minus = parallel(
        lambda: complete(client, max_tokens=4, logit_bias={str(target): 100}, extra_body={"ignore_eos": True}),
        lambda: complete(client, max_tokens=3, logit_bias={str(ids[0]): -100}),
    )
    assert plus.choices[0].text == token_text(server.port, target) * 4  # +100: the whole output
    assert not minus.choices[0].text.startswith(texts[0])  # -100: the greedy token is banned
    status, body = post_json(server.port, "/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 5}})
    assert status == 400 and body["error"]["param"] == "logit_bias"


def _repeats(r: Any) -> int:
    tokens = r.choices[0].logprobs.tokens
    return len(tokens) - len(set(tokens))


def test_penalties_reduce_repetition(client):
    def run(**extra: Any) -> Any:  # a greedy continuation of a repetitive prompt
        return lambda: complete(client, prompt="one one one one one one one one one one one one", max_tokens=12,
                                logprobs=0, extra_body={"ignore_eos": True, **extra})  # fmt: skip

    base, *penalized = parallel(run(), run(frequency_penalty=2.0), run(presence_penalty=2.0),
                                run(repetition_penalty=3.0))  # fmt: skip
    for name, r in zip(("frequency", "presence", "repetition"), penalized):
        assert _repeats(r) < _repeats(base), (name, r.choices[0].text, base.choices[0].text)


def test_min_tokens_delays_eos(client):
    msgs = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    base, r = parallel(
        lambda: client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0),
        lambda: client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0,
                                               extra_body={"min_tokens": 8}),
    )  # fmt: skip
    assert base.choices[0].finish_reason == "stop" and base.usage.completion_tokens < 8, base
    assert r.usage.completion_tokens >= 8


def test_seed_reproducible(client):
    def sample(seed: int) -> Any:
        return lambda: client.completions.create(model="m", prompt="My favourite animal is", max_tokens=6,
                                                 temperature=1.0, seed=seed).choices[0].text  # fmt: skip

    a, b, *others = parallel(sample(5), sample(5), sample(1), sample(2), sample(3))
    assert a == b and len({a, *others}) > 1


# ---------------------------------------------------------------- stops


def test_stop_string_reason_and_include(client, ref):
    full = "".join(ref[1])
    stop = full.split()[1]
    body = {"max_tokens": 10, "stop": [stop, "zzz"]}
    cut, kept = parallel(
        lambda: complete(client, **body, extra_body={"ignore_eos": True}).choices[0],
        lambda: complete(client, **body, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0],
    )  # fmt: skip
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    assert kept.text == full[: full.index(stop) + len(stop)] and kept.model_extra["stop_reason"] == stop


def test_stop_token_ids(client, ref):
    ids, texts = ref
    stop_id = ids[2]
    assert stop_id not in ids[:2]
    body = {"ignore_eos": True, "stop_token_ids": [stop_id]}
    r, kept = parallel(lambda: complete(client, max_tokens=6, extra_body=body),
                       lambda: complete(client, max_tokens=6, extra_body={**body, "include_stop_str_in_output": True}))
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop_id
    assert c.text == "".join(texts[:2]) and r.usage.completion_tokens == 3
    assert kept.choices[0].text == "".join(texts[:3])


def test_stop_string_across_tokens_never_streamed(server, ref):
    texts = ref[1]
    # The end of token 3 plus the start of token 4: a stop string split between two tokens.
    left, right = texts[3], texts[4]
    assert len(left) >= 2 and len(right) >= 1, texts
    stop = left[-2:] + right[:2]
    full = "".join(texts)
    lines = sse_lines(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                       "ignore_eos": True, "stop": [stop], "stream": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [e["choices"][0]["text"] for e in events]
    assert len(deltas) > 2 and not any(stop in d for d in deltas)
    assert "".join(deltas) == full[: full.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and events[-1]["choices"][0]["stop_reason"] == stop


# ---------------------------------------------------------------- logprobs and echo


def _check_top(entry_logprob: float, entry_token: str, tops: list[tuple[str, float]], k: int) -> None:
    assert len(tops) == k
    values = [v for _, v in tops]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    for token, value in tops:
        if token == entry_token:
            assert math.isclose(value, entry_logprob, abs_tol=1e-4)


def test_chat_logprobs_shape_and_values(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        tops = [(t.token, t.logprob) for t in entry.top_logprobs]
        _check_top(entry.logprob, entry.token, tops, 3)
        assert entry.token == tops[0][0]  # greedy: the chosen token is the most likely one
    text = "".join(e.token for e in content)
    assert text.startswith(r.choices[0].message.content)
    # streamed: the same entries, spread over the chunks
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True)  # fmt: skip
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # Values to 2e-3, not bit for bit: the second request finds the prompt in the prefix cache and
    # computes its last token alone (the quantized GEMV's summation order, not the prefill GEMM's),
    # and the default server's K/V pages are fp16, so its keys can round the other way (measured:
    # 6e-4 at one token). A wrong entry (another position or token) is off by far more.
    for mine, ref in zip(streamed, content):
        assert math.isclose(mine.logprob, ref.logprob, abs_tol=2e-3), (mine.token, mine.logprob, ref.logprob)


def test_chat_logprobs_zero_top(client):
    r, plain = parallel(
        lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, temperature=0, logprobs=True),
        lambda: client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, temperature=0),
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(e.top_logprobs == [] for e in content)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape(client):
    r = complete(client, max_tokens=5, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and math.isclose(top[token], value, abs_tol=1e-4)
        assert value == max(top.values())  # greedy
        assert 1 <= len(top) <= 3


def test_echo_with_and_without_logprobs(client, ref):
    r = complete(client, max_tokens=3, echo=True, extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPT + "".join(ref[1][:3])
    r = complete(client, max_tokens=3, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text


def test_echo_token_prompt_is_detokenized(server, client):
    ids = [504, 3458, 314]
    status, body = post_json(server.port, "/detokenize", {"tokens": ids})
    assert status == 200
    echoed, plain = parallel(lambda: complete(client, prompt=ids, max_tokens=2, echo=True),
                             lambda: complete(client, prompt=ids, max_tokens=2))  # fmt: skip
    assert echoed.choices[0].text == body["prompt"] + plain.choices[0].text


def test_echo_stream_starts_with_prompt(server):
    lines = sse_lines(server.port, "/v1/completions",
                      {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["text"].startswith(PROMPT)


def test_include_usage_only_when_asked(server):
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True}
    lines = sse_lines(server.port, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in e for e in events[:-1])
    lines = sse_lines(server.port, "/v1/chat/completions", body)
    assert all("usage" not in json.loads(line[6:]) for line in lines[:-1])
