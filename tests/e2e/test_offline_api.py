"""The offline `LLM` is the server's request path in-process: a vLLM-style script works as it does
with vLLM, and the offline engine and the HTTP server give the same greedy chat answer, with
stop strings, n=2 and logprobs (same text, finish and stop reasons, token logprobs)."""

from __future__ import annotations

from typing import Any

import pytest

from minisgl import SamplingParams
from minisgl.core import SamplingError
from tests.e2e.service import post_json

CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name the first four months of the year."}]  # fmt: skip
MAX = 24


def _ranked(entry: dict[int, Any]) -> list[tuple[int, float]]:
    return [(t, lp.logprob) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0) if lp.rank is not None]


def test_vllm_style_offline_script(served_offline):
    llm = served_offline
    prompts = ["One, two, three,", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=16, stop=[","], logprobs=2),
                           use_tqdm=False)  # fmt: skip
    assert [o.prompt for o in outputs] == prompts
    assert [o.prompt_token_ids for o in outputs] == [llm.encode(p) for p in prompts]
    assert outputs[0].request_id != outputs[1].request_id and all(o.finished for o in outputs)
    first = outputs[0].outputs[0]
    assert first.text == " four" and "," not in first.text
    assert (first.finish_reason, first.stop_reason) == ("stop", ",")
    for out in outputs:
        assert [c.index for c in out.outputs] == [0, 1]
        assert out.outputs[0].text == out.outputs[1].text  # greedy: both samples agree
        for c in out.outputs:
            assert "," not in c.text
            assert c.finish_reason in ("stop", "length")
            assert (c.stop_reason is None) == (c.finish_reason == "length" or c.stop_reason is None)
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
            for token, entry in zip(c.token_ids, c.logprobs):
                assert token in entry and [rank for rank in sorted(lp.rank for lp in entry.values() if lp.rank)] == [1, 2]
                assert entry[token].decoded_token is not None
            assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    # Sampling with a seed: choice i uses seed + i, so a rerun gives the same n samples.
    sampled = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8)
    again = [llm.generate(prompts[1], sampled, use_tqdm=False)[0] for _ in range(2)]
    assert [c.text for c in again[0].outputs] == [c.text for c in again[1].outputs]


def test_offline_errors_are_the_servers(server, served_offline):
    with pytest.raises(SamplingError) as info:
        SamplingParams(top_p=0)
    assert info.value.param == "top_p"
    with pytest.raises(ValueError) as offline_err:
        served_offline.generate([[1, 2], [5, 10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    status, body = post_json(server.port, "/v1/completions", {"prompt": [5, 10**6], "max_tokens": 2})
    assert status == 400 and body["error"]["message"] == str(offline_err.value)
    assert not served_offline.scheduler.has_work() and not served_offline.scheduler.reqs  # the first was aborted
    with pytest.raises(ValueError, match="maximum context length"):
        served_offline.generate([[5] * (served_offline.scheduler.context_len + 1)], use_tqdm=False)
    with pytest.raises(TypeError, match="valid: model, .*page_size"):
        type(served_offline)(device="cpu", not_a_setting=1)


def test_offline_and_server_same_greedy_chat_with_stop_n_and_logprobs(server, served_offline):
    plain = served_offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX), use_tqdm=False)[0].outputs[0]
    words = plain.text.split()
    assert len(words) >= 3, plain.text
    stop = words[2]
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX, stop=[stop], logprobs=2)
    mine = served_offline.chat(CHAT, params, use_tqdm=False)[0]
    status, body = post_json(server.port, "/v1/chat/completions", {
        "model": "m", "messages": CHAT, "max_tokens": MAX, "temperature": 0, "n": 2, "stop": [stop],
        "logprobs": True, "top_logprobs": 2})  # fmt: skip
    assert status == 200, body
    choices = body["choices"]
    assert len(mine.outputs) == len(choices) == 2
    assert mine.prompt_token_ids == served_offline.apply_chat_template(CHAT)
    assert body["usage"]["prompt_tokens"] == len(mine.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in mine.outputs)
    for out, choice in zip(mine.outputs, choices):
        assert choice["index"] == out.index
        assert choice["message"]["content"] == out.text == plain.text[: plain.text.index(stop)]
        assert choice["finish_reason"] == out.finish_reason == "stop"
        assert choice["stop_reason"] == out.stop_reason == stop
        served = choice["logprobs"]["content"]
        assert out.logprobs is not None and len(served) == len(out.logprobs) == len(out.token_ids)
        for token, entry, got in zip(out.token_ids, out.logprobs, served):
            assert got["token"] == entry[token].decoded_token
            assert got["logprob"] == pytest.approx(entry[token].logprob, abs=1e-3)
            tops = _ranked(entry)
            assert [t["token"] for t in got["top_logprobs"]] == [entry[t].decoded_token for t, _ in tops]
            assert [t["logprob"] for t in got["top_logprobs"]] == pytest.approx([v for _, v in tops], abs=1e-3)
