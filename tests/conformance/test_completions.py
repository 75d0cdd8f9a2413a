"""Text completions: every prompt form (text, token ids, a list of either) with echo and
logprobs, n with a list of prompts (usage counts each prompt once), streaming shapes."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import error_of, stream_events
from tests.e2e.service import parallel, post_json

PATH = "/v1/completions"
PROMPT = "What is an LLM?"


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    status, body = post_json(server.port, "/tokenize", {"prompt": PROMPT})
    assert status == 200
    return body["tokens"]


def test_non_stream_shape(client):
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].text, str)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_cut_by_max_tokens_vllm(server, client):
    """vLLM's test_completion_streaming: one finish_reason, "length", on the last chunk, which
    still carries text; the chunks spell the non-streamed text."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    single, chunks = parallel(lambda: client.completions.create(**body),
                              lambda: list(client.completions.create(**body, stream=True)))  # fmt: skip
    finishes = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert finishes == [chunks[-1]] and chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == single.choices[0].text


def test_stream_usage(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    events, plain = parallel(lambda: stream_events(server, PATH, {**body, "stream_options": {"include_usage": True}}),
                             lambda: stream_events(server, PATH, body))
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    assert all(e["object"] == "text_completion" for e in events)
    assert all("usage" not in e for e in plain)


def test_echo_logprobs_on_every_prompt_form(client, prompt_ids, token):
    """Text, token ids, a list of texts, a list of id lists: the echo and the prompt's logprobs
    lead each choice, the tokens spell the text, offsets count token texts."""
    tid, text = token
    forms = [PROMPT, prompt_ids, [PROMPT, PROMPT], [prompt_ids, prompt_ids]]
    results = parallel(*[lambda p=p: client.completions.create(model="m", prompt=p, max_tokens=2, echo=True, logprobs=1,
                                                               logit_bias={str(tid): 100}) for p in forms])  # fmt: skip
    for count, r in zip([1, 1, 2, 2], results):
        assert len(r.choices) == count
        for choice in r.choices:
            lp = choice.logprobs
            assert choice.text == PROMPT + text * 2 and len(lp.tokens) == len(prompt_ids) + 2
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert all(v <= 0 for v in lp.token_logprobs[1:])
            assert "".join(lp.tokens) == choice.text
            assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert r.usage.prompt_tokens == len(prompt_ids) * len(r.choices)


@pytest.mark.parametrize("logprobs", [None, 0])
def test_echo_special_tokens_keep_their_text(client, logprobs):
    """Five copies of token 0 (`<|endoftext|>` in byte-level BPE vocabularies) echo as that text,
    what vLLM and llama.cpp return: the echo spells the prompt's tokens."""
    r, r2 = parallel(
        lambda: client.completions.create(model="m", prompt=[0] * 5, max_tokens=1, echo=True, logprobs=0),
        lambda: client.completions.create(model="m", prompt=[0] * 5, max_tokens=1, echo=True, logprobs=logprobs))
    tokens = r.choices[0].logprobs.tokens
    assert tokens[0] and all(t == tokens[0] for t in tokens[:5])
    assert r2.choices[0].text.startswith(tokens[0] * 5) and r.choices[0].text.startswith(tokens[0] * 5)


def test_echo_without_generation(server, prompt_ids):
    status, r = post_json(server.port, PATH, {"prompt": PROMPT, "echo": True, "max_tokens": 1, "logprobs": 0})
    assert status == 200 and r["choices"][0]["text"].startswith(PROMPT)


def test_list_of_prompts_with_n_counts_each_prompt_once(server, prompt_ids):
    body = {"prompt": [prompt_ids[:5], prompt_ids[:5]], "n": 2, "max_tokens": 2, "ignore_eos": True, "seed": 3,
            "temperature": 1}  # fmt: skip
    usage_body = {**body, "stream_options": {"include_usage": True}}
    (status, r), events = parallel(lambda: post_json(server.port, PATH, body),
                                   lambda: stream_events(server, PATH, usage_body))
    assert status == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["prompt_tokens"] == 10 and r["usage"]["completion_tokens"] == 8
    assert events[-1]["usage"]["prompt_tokens"] == 10
    per_index: dict[int, str] = {}
    for e in events[:-1]:
        assert len(e["choices"]) == 1
        per_index[e["choices"][0]["index"]] = per_index.get(e["choices"][0]["index"], "") + e["choices"][0]["text"]
    assert sorted(per_index) == [0, 1, 2, 3]
    assert [per_index[i] for i in range(4)] == [c["text"] for c in r["choices"]]  # same seeds, same texts


def test_parallel_streaming_n3(server):
    events = stream_events(server, PATH, {"prompt": PROMPT, "n": 3, "max_tokens": 2, "ignore_eos": True})
    finishes = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"] == "length"]
    assert sorted(finishes) == [0, 1, 2]


def test_logprobs_stream_offsets_continue(server, token):
    events = stream_events(server, PATH, {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2,
                                          "logit_bias": {str(token[0]): 100}})  # fmt: skip
    tokens, offsets, text = [], [], ""
    for e in events:
        lp = e["choices"][0]["logprobs"]
        text += e["choices"][0]["text"]
        if lp:
            tokens += lp["tokens"]
            offsets += lp["text_offset"]
            assert all(len(top) <= 3 for top in lp["top_logprobs"])
    assert len(tokens) == 3 and "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(3)]


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [[1], "a"], 5, None, [True]])
def test_bad_prompts(server, prompt):
    status, err = error_of(server, PATH, {"prompt": prompt, "max_tokens": 1})
    assert status == 400 and err["param"] == "prompt", err


def test_prompt_token_out_of_vocab(server):
    status, err = error_of(server, PATH, {"prompt": [10**9], "max_tokens": 1})
    assert status == 400, err
