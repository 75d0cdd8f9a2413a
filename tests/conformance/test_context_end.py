"""finish_reason at the end of the context: a server with a 64-token window, a request without
max_tokens generates until the window is full and ends with "length"."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conformance.conftest import error_of, stream_events
from tests.e2e.service import Server, parallel, post_json, start_server

WINDOW = 48


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "small-context", "--max-model-len", str(WINDOW))
    yield srv
    srv.stop()


def test_generation_ends_at_the_context(small):
    prompt = {"messages": [{"role": "user", "content": "Count."}], "ignore_eos": True}
    (status, r), events = parallel(
        lambda: post_json(small.port, "/v1/chat/completions", prompt),
        lambda: stream_events(small, "/v1/chat/completions", {**prompt, "stream_options": {"include_usage": True}}))
    assert status == 200 and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["total_tokens"] == WINDOW
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["total_tokens"] == WINDOW


def test_prompt_past_the_context_is_400(small):
    status, err = error_of(small, "/v1/completions", {"prompt": "word " * 200, "max_tokens": 1})
    assert status == 400 and "context" in err["message"], err
    status, err = error_of(small, "/v1/completions", {"prompt": "hi", "max_tokens": WINDOW + 1})
    assert status == 400 and err["param"] == "max_tokens", err
