"""A server with `--speculative-algorithm ngram`: greedy answers equal the offline engine's without
speculation (non-streaming and streaming, several tokens per step), a stop string inside an
accepted run still ends the text, and /metrics counts the proposals."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from minisgl import SamplingParams
from minisgl.bench.spec_workload import CONVERSATIONS
from tests.e2e.service import Server, parallel, request, start_server


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "spec", "--speculative-algorithm", "ngram", "--num-speculative-tokens", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server: Server) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="none", max_retries=0, timeout=300)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_greedy_answers_equal_offline(spec_server: Server, spec_client: Any, offline: Any) -> None:
    conversations = CONVERSATIONS[:2]
    want = offline.chat(conversations, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)

    def ask(messages: list[dict[str, str]]) -> Any:
        return spec_client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=40)

    got = parallel(*(lambda m=m: ask(m) for m in conversations))  # verify rows of several requests in one batch
    for reply, expected in zip(got, want):
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)

    stream = spec_client.chat.completions.create(model="m", messages=conversations[0], temperature=0,
                                                 max_tokens=40, stream=True)  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == want[0].outputs[0].text

    status, raw = request(spec_server.port, "GET", "/metrics")
    assert status == 200
    metrics = raw.decode()
    drafts = _metric(metrics, "minisgl_spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "minisgl_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > 0
    assert _metric(metrics, "minisgl_spec_decode_acceptance_ratio") == pytest.approx(accepted / drafts, rel=1e-3)
    assert _metric(metrics, "minisgl_spec_decode_mean_accepted_length") > 1.0


def test_stop_string_inside_accepted_tokens(spec_client: Any, offline: Any) -> None:
    messages = CONVERSATIONS[0]
    full = offline.chat([messages], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0].text
    assert len(full) > 40, full
    middle = len(full) // 2
    stop = full[middle : middle + 6]  # inside a copied run, where proposals are accepted
    want = offline.chat([messages], SamplingParams(temperature=0, max_tokens=64, stop=[stop]),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    reply = spec_client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=64, stop=[stop])
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == "stop"
    assert stop not in reply.choices[0].message.content
