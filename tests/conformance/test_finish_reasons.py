"""finish_reason (and vLLM's stop_reason) under every stop cause, chat and completions, stream
and not: EOS, stop string, stop token, max_tokens. Outputs are pinned without the model's words:
a forced token (logit_bias +100) or a constant JSON schema, after which only EOS is allowed.
Context end is in test_context_end.py."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import stream_events
from tests.e2e.service import parallel, post_json

MSGS = [{"role": "user", "content": "Say something."}]


def ask(server, kind: str, stream: bool, **fields):
    path, base = (("/v1/chat/completions", {"messages": MSGS}) if kind == "chat"
                  else ("/v1/completions", {"prompt": "Say something."}))  # fmt: skip
    body = {**base, **fields}
    if not stream:
        status, r = post_json(server.port, path, body)
        assert status == 200, r
        c = r["choices"][0]
        return (c["message"]["content"] if kind == "chat" else c["text"]), c["finish_reason"], c["stop_reason"], r
    events = stream_events(server, path, {**body, "stream_options": {"include_usage": True}})
    text = "".join((e["choices"][0]["delta"].get("content") or "") if kind == "chat" else e["choices"][0]["text"]
                   for e in events if e["choices"])  # fmt: skip
    last = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(last) == 1
    return text, last[0]["finish_reason"], last[0]["stop_reason"], events[-1]


CASES = [("chat", False), ("chat", True), ("completion", False), ("completion", True)]


def each_case(server, **fields):
    """The same request as chat and completion, streamed and not, at once (one batch)."""
    return parallel(*[lambda kind=kind, stream=stream: ask(server, kind, stream, **fields) for kind, stream in CASES])


def test_eos(server):
    schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": "ok"}}}
    for text, finish, reason, _ in each_case(server, response_format=schema, max_tokens=8, temperature=0):
        assert text == '"ok"' and finish == "stop" and reason is None


def test_max_tokens(server, token):
    tid, text = token
    for out, finish, reason, last in each_case(server, max_tokens=2, logit_bias={str(tid): 100}):
        assert out == text * 2 and finish == "length" and reason is None
        assert last["usage"]["completion_tokens"] == 2


def test_stop_token(server, token):
    tid, _ = token
    for out, finish, reason, last in each_case(server, max_tokens=4, logit_bias={str(tid): 100}, stop_token_ids=[tid]):
        assert out == "" and finish == "stop" and reason == tid and last["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_string(server, token, include):
    """A stop string spanning two tokens: the text before it is sent, the string itself only with
    include_stop_str_in_output."""
    tid, text = token
    stop = text[-1] + text[0]
    results = each_case(server, max_tokens=4, logit_bias={str(tid): 100}, stop=[stop],
                        include_stop_str_in_output=include)  # fmt: skip
    for out, finish, reason, _ in results:
        assert out == (text + text[0] if include else text[:-1]) and finish == "stop" and reason == stop
