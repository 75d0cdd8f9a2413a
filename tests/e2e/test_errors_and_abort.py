"""Bad requests get OpenAI-shaped 400s (never 422/500/hang); disconnects abort and free pages."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.e2e.service import get_json, post_json, request, wait_idle

OK_MSGS = [{"role": "user", "content": "hi"}]
LONG = {"model": "m", "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
        "max_tokens": 2000, "temperature": 0, "ignore_eos": True}  # fmt: skip

BAD_CHAT = [
    b"{not json",
    b"",
    b"[1, 2]",
    b"{}",
    json.dumps({"model": "m", "messages": []}).encode(),
    json.dumps({"model": "m", "messages": "hello"}).encode(),
    json.dumps({"model": "m", "messages": [{"role": 7, "content": "x"}]}).encode(),  # custom string roles are allowed
    json.dumps({"model": "m", "messages": [{"role": "user"}]}).encode(),
    json.dumps({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(),  # noqa: E501
    json.dumps({"model": "m", "messages": OK_MSGS, "max_tokens": -5}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "max_tokens": "ten"}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "temperature": -1}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "top_p": 7}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "stream": "yes"}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "stop": 3}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "frequency_penalty": 3.5}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "top_logprobs": 2}).encode(),  # without logprobs
    json.dumps({"model": "m", "messages": OK_MSGS, "logit_bias": {"10000000": 1}}).encode(),  # outside the vocabulary
    json.dumps({"model": "m", "messages": OK_MSGS, "tools": [{"type": "function"}]}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "mystery_option": 1}).encode(),
    json.dumps({"model": "m", "messages": OK_MSGS, "max_tokens": 100000}).encode(),  # beyond the context
    json.dumps({"model": "m", "messages": OK_MSGS, "max_tokens": 100000, "stream": True}).encode(),
]
BAD_COMPLETIONS = [
    json.dumps({"model": "m"}).encode(),
    json.dumps({"model": "m", "prompt": []}).encode(),
    json.dumps({"model": "m", "prompt": [1, "x"]}).encode(),
    json.dumps({"model": "m", "prompt": [10**9]}).encode(),  # token id outside the vocabulary
    json.dumps({"model": "m", "prompt": "", "max_tokens": 3}).encode(),  # empty prompt
    json.dumps({"model": "m", "prompt": "x", "suffix": "y"}).encode(),
    json.dumps({"model": "m", "prompt": "x", "logprobs": 50}).encode(),
]


def check_error(status: int, body: bytes, expected: int = 400) -> dict:
    assert status == expected, (status, body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("body", BAD_CHAT, ids=range(len(BAD_CHAT)))
def test_bad_chat_request_is_400(server, body):
    status, data = request(server.port, "POST", "/v1/chat/completions", body, timeout=30)
    check_error(status, data)


@pytest.mark.parametrize("body", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_bad_completion_request_is_400(server, body):
    status, data = request(server.port, "POST", "/v1/completions", body, timeout=30)
    check_error(status, data)


def test_error_names_the_field(server):
    status, data = request(server.port, "POST", "/v1/chat/completions",
                           json.dumps({"messages": OK_MSGS, "max_tokens": -1}).encode())  # fmt: skip
    err = check_error(status, data)
    assert err["param"] == "max_tokens" and "max_tokens" in err["message"]
    status, data = request(server.port, "POST", "/v1/chat/completions",
                           json.dumps({"messages": OK_MSGS, "max_tokens": 100000}).encode())  # fmt: skip
    assert "context length" in check_error(status, data)["message"]


def test_unknown_route_and_method(server):
    check_error(*request(server.port, "GET", "/v1/nothing"), expected=404)
    check_error(*request(server.port, "POST", "/v2/chat/completions", b"{}"), expected=404)
    check_error(*request(server.port, "GET", "/v1/chat/completions"), expected=405)


def test_server_healthy_after_bad_requests(server, client):
    assert get_json(server.port, "/health")[0] == 200
    r = client.chat.completions.create(model="m", messages=OK_MSGS, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    wait_idle(server.port)


def _open_request(port: int, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    return sock


def _aborts(server) -> int:
    return server.log().count("Aborting request")


def _wait_for(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_disconnect_mid_stream_aborts_and_frees_pages(server, client):
    before = _aborts(server)
    total = wait_idle(server.port)["total_pages"]
    sock = _open_request(server.port, {**LONG, "stream": True})
    got = b""
    while got.count(b"data: ") < 4:  # a few chunks: the request is running
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    assert b" 200 " in got.split(b"\r\n", 1)[0]
    _, stats = get_json(server.port, "/v1/internal/stats")
    assert stats["running"] == 1 and stats["free_pages"] < total
    sock.close()
    _wait_for(lambda: _aborts(server) >= before + 2)  # the API server's and the scheduler's log lines
    stats = wait_idle(server.port)
    assert stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"] == total
    r = client.chat.completions.create(model="m", messages=OK_MSGS, max_tokens=3, temperature=0)
    assert r.choices[0].message.content is not None


def test_disconnect_non_streaming_aborts(server):
    before = _aborts(server)
    sock = _open_request(server.port, LONG)
    _wait_for(lambda: get_json(server.port, "/v1/internal/stats")[1]["running"] == 1)
    sock.close()
    _wait_for(lambda: _aborts(server) >= before + 2)
    wait_idle(server.port)
