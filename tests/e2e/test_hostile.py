"""Hostile input against the real server on CPU (the shared default server): every answer is a
4xx in OpenAI's error shape or a normal answer, never a 5xx or a hang, and the server stays
healthy and idle afterwards.

- a 10 MB body is a 413, with Content-Length or chunked, without the body being read (fast);
  a large body under the limit is served;
- JSON nested deeper than the parser allows is a 400 on every POST route;
- lone surrogates are a 400 (not valid JSON text), NUL bytes are served;
- token ids out of range or negative are a 400 naming the field;
- catastrophic regexes compile (xgrammar builds automata, nothing backtracks); regexes and
  schemas beyond the compile limits, and circular schemas, are a 400 quickly;
- 100k-token prompts (ids or text) are a 400 on the context length within seconds;
- clients that never read their stream, or read it slowly: the server's memory stays bounded
  (see frontend.Inbox for where the bound is) and it keeps serving others.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from typing import Any

import pytest

from minisgl.bench.rawhttp import http_call
from tests.e2e.service import Server, get_json, post_json, request, wait_idle

psutil = pytest.importorskip("psutil")

CHAT = "/v1/chat/completions"
POST_ROUTES = [CHAT, "/v1/completions", "/generate", "/tokenize", "/detokenize"]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def assert_error(status: int, data: Any, want: int = 400, param: str | None = None) -> None:
    assert status == want, (status, data)
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err


def timed_post(port: int, path: str, body: bytes, timeout: float = 60) -> tuple[int, Any, float]:
    start = time.monotonic()
    status, data = request(port, "POST", path, body, timeout=timeout)
    return status, json.loads(data), time.monotonic() - start


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


# ----------------------------------------------------------------------------------- bodies


def test_10mb_body_is_413_without_reading_it(server: Server) -> None:
    big = b'{"model": "m", "prompt": "' + b"x" * 10_000_000 + b'", "max_tokens": 1}'
    for path in (CHAT, "/v1/completions", "/tokenize"):
        status, data, took = timed_post(server.port, path, big)
        assert_error(status, data, 413)
        assert data["error"]["code"] == "request_too_large" and took < 10, took
    # With `Connection: close` (bench/rawhttp.py): the server reads the rest before it answers and
    # closes, so the client gets the 413 rather than a connection reset.
    reply = asyncio.run(asyncio.wait_for(http_call("127.0.0.1", server.port, "POST", CHAT, big), 60))
    assert_error(reply.status, json.loads(reply.body), 413)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # chunked: counted as it arrives
    try:
        chunks = (b"x" * 100_000 for _ in range(100))
        conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})  # fmt: skip
        resp = conn.getresponse()
        assert_error(resp.status, json.loads(resp.read()), 413)
    finally:
        conn.close()
    # 3 MB, under the 4 MiB limit, in a field the server ignores: served.
    status, data = post_json(server.port, CHAT, chat(metadata={"note": "y" * 3_000_000}))
    assert status == 200 and data["usage"]["completion_tokens"] == 2, data


@pytest.mark.parametrize("path", POST_ROUTES)
def test_deep_nesting_is_400(server: Server, path: str) -> None:
    depth = 100_000
    body = b'{"model": "m", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    status, data, took = timed_post(server.port, path, body)
    assert_error(status, data)
    assert "recursion limit" in data["error"]["message"] and took < 5, (data, took)
    nested_dicts = b'{"a": ' * 5000 + b"1" + b"}" * 5000  # the whole body
    status, data, _ = timed_post(server.port, path, nested_dicts)
    assert_error(status, data)


# ------------------------------------------------------------------------------------ text


@pytest.mark.parametrize(
    "path, raw",
    [(CHAT, '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
     (CHAT, '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\udc00"}]}'),
     ("/v1/completions", '{"model": "m", "max_tokens": 2, "prompt": "\\udfff"}'),
     ("/v1/completions", '{"model": "m", "max_tokens": 2, "prompt": "x", "stop": ["\\ud800"]}'),
     ("/generate", '{"text": "\\ud83d", "sampling_params": {"max_new_tokens": 2}}'),
     ("/tokenize", '{"prompt": "\\ud800\\ud800"}')],
)  # fmt: skip
def test_lone_surrogates_are_400(server: Server, path: str, raw: str) -> None:
    status, data, _ = timed_post(server.port, path, raw.encode())
    assert_error(status, data)
    assert "surrogate" in data["error"]["message"] or "escape" in data["error"]["message"], data


def test_nul_bytes_are_served(server: Server) -> None:
    port = server.port
    status, data = post_json(port, CHAT, {**chat(), "messages": [{"role": "user", "content": "a\u0000b\u0000"}]})
    assert status == 200 and data["usage"]["completion_tokens"] == 2, data
    status, data = post_json(port, "/v1/completions", {"model": "m", "prompt": "\u0000" * 8, "max_tokens": 2,
                                                       "stop": ["\u0000"]})  # fmt: skip
    assert status == 200 and data["choices"][0]["finish_reason"] in ("length", "stop"), data
    status, data = post_json(port, "/tokenize", {"prompt": "x\u0000y"})
    assert status == 200 and data["count"] >= 2
    status, data = post_json(port, "/generate", {"text": "\u0000", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and len(data["output_ids"]) == 1, data


# ----------------------------------------------------------------------------------- token ids


@pytest.mark.parametrize(
    "path, body, param",
    [("/v1/completions", {"model": "m", "prompt": [1, -5], "max_tokens": 1}, "prompt"),
     ("/v1/completions", {"model": "m", "prompt": [1, 49152], "max_tokens": 1}, "prompt"),
     ("/v1/completions", {"model": "m", "prompt": [[1], [10**9]], "max_tokens": 1}, "prompt"),
     ("/v1/completions", {"model": "m", "prompt": "x", "stop_token_ids": [-1], "max_tokens": 1}, "stop_token_ids"),
     ("/v1/completions", {"model": "m", "prompt": "x", "stop_token_ids": [10**7], "max_tokens": 1},
      "stop_token_ids"),
     (CHAT, chat(logit_bias={"-3": 1}), "logit_bias"),
     (CHAT, chat(logit_bias={"99999999": 1}), "logit_bias"),
     ("/generate", {"input_ids": [-1], "sampling_params": {"max_new_tokens": 1}}, None),
     ("/generate", {"input_ids": [49152], "sampling_params": {"max_new_tokens": 1}}, None),
     ("/detokenize", {"tokens": [-1]}, "tokens"),
     ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
     ("/detokenize", {"tokens": [2**70]}, "tokens"),
     ("/v1/completions", {"model": "m", "prompt": [2**64], "max_tokens": 1}, None)],
    ids=["negative", "vocab", "vocab-batch", "stop-negative", "stop-vocab", "bias-negative", "bias-vocab",
         "generate-negative", "generate-vocab", "detok-negative", "detok-vocab", "detok-huge", "beyond-int64"],
)  # fmt: skip
def test_token_ids_out_of_range_are_400(server: Server, path: str, body: dict[str, Any], param: str | None) -> None:
    status, data = post_json(server.port, path, body)
    assert_error(status, data, param=param)
    if param is None:
        assert data["error"]["message"]


# ----------------------------------------------------------------------------------- grammars

WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
CIRCULAR = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
LINKED = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}},
                          "required": ["v"]}}, "$ref": "#/$defs/n"}  # fmt: skip


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def deep_schema(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


@pytest.mark.parametrize("regex", ["(a+)+$", "(a|a)*(b|aa)*c", "(.*a){12}", "((ab)*|(ba)*)*x"])
def test_catastrophic_regexes_compile_and_run(server: Server, regex: str) -> None:
    status, data, took = timed_post(server.port, CHAT, json.dumps(chat(regex=regex, max_tokens=4)).encode())
    assert status == 200 and data["choices"][0]["finish_reason"] in ("length", "stop"), data
    assert took < 60, took  # the first grammar builds the tokenizer's tables (~10 s on 2 cores)


@pytest.mark.parametrize(
    "body, needle",
    [(chat(regex="[a-z]{1,100000}"), "repeats 100000 times"),
     (chat(regex="x" * 20_000), "too long"),
     (chat(regex="(" * 80 + "a" + ")" * 80), "nests 80 levels"),
     (chat(response_format=schema_format(WIDE)), "1000 optional properties"),
     (chat(response_format=schema_format({"type": "string", "pattern": "a{1,99999}"})), "repeats 99999"),
     (chat(response_format=schema_format(deep_schema(40))), "levels deep"),
     (chat(response_format=schema_format(CIRCULAR)), "Circular"),
     (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep_schema(40)}}],
           tool_choice="required"), "levels deep"),
     ({"text": "x", "sampling_params": {"max_new_tokens": 1, "json_schema": json.dumps(WIDE)}}, "optional")],
    ids=["repeat", "long-regex", "deep-regex", "wide-schema", "schema-pattern", "deep-schema", "circular",
         "deep-tool", "generate-wide"],
)  # fmt: skip
def test_grammars_beyond_the_limits_are_400(server: Server, body: dict[str, Any], needle: str) -> None:
    path = "/generate" if "text" in body else CHAT
    status, data, took = timed_post(server.port, path, json.dumps(body).encode())
    assert_error(status, data)
    assert needle in data["error"]["message"] and took < 30, (data, took)


def test_recursive_schema_is_served(server: Server) -> None:
    status, data = post_json(server.port, CHAT, chat(response_format=schema_format(LINKED), max_tokens=8))
    assert status == 200 and data["choices"][0]["message"]["content"].startswith("{"), data


# ------------------------------------------------------------------------------------- long prompts


@pytest.mark.parametrize(
    "path, body",
    [("/v1/completions", {"model": "m", "prompt": [100] * 100_000, "max_tokens": 1}),
     ("/v1/completions", {"model": "m", "prompt": "hello " * 100_000, "max_tokens": 1}),
     (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hello " * 100_000}], "max_tokens": 1}),
     ("/generate", {"input_ids": [100] * 100_000, "sampling_params": {"max_new_tokens": 1}})],
    ids=["ids", "text", "chat", "generate"],
)  # fmt: skip
def test_100k_token_prompts_are_400_fast(server: Server, path: str, body: dict[str, Any]) -> None:
    status, data, took = timed_post(server.port, path, json.dumps(body).encode())
    assert_error(status, data)
    assert "context length" in data["error"]["message"] and took < 10, (data, took)


# ------------------------------------------------------------------------- readers that do not read


def open_stream(port: int, body: dict[str, Any]) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer, and never read it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)  # fmt: skip
    return sock


STREAMS = 10


def test_clients_that_never_read_keep_memory_bounded(server: Server) -> None:
    """8 streams of 64 tokens with 5 top logprobs each (~50 KB of events per stream) that are
    never read, and 2 read one small piece a second: the API server's memory grows by a bounded
    amount, others are served meanwhile, and every page and reply state comes back once the
    clients go away."""
    port = server.port
    pids = {"api": server.health()["pid"], **server.child_pids()}
    body = chat(max_tokens=64, ignore_eos=True, stream=True, logprobs=True, top_logprobs=5,
                messages=[{"role": "user", "content": "Tell me a story."}])  # fmt: skip
    wait_idle(port)
    before = {name: rss_mb(pid) for name, pid in pids.items()}
    silent = [open_stream(port, body) for _ in range(STREAMS - 2)]
    slow = [open_stream(port, body) for _ in range(2)]
    try:
        deadline = time.monotonic() + 400
        peak = dict(before)
        started = finished = False
        while time.monotonic() < deadline:
            for sock in slow:
                sock.setblocking(False)
                try:
                    sock.recv(512)
                except BlockingIOError:
                    pass
            peak = {name: max(peak[name], rss_mb(pid)) for name, pid in pids.items()}
            status, stats = get_json(port, "/v1/internal/stats")
            if status != 200:  # a long decode step kept the scheduler from answering within 5 s
                continue
            started = started or stats["running"] > 0
            if started and stats["running"] == 0 and stats["waiting"] == 0:
                finished = True  # every token generated: what is left waits for the readers
                break
            time.sleep(1.0)
        assert finished, stats  # (the replies left wait for their readers, in inboxes or socket buffers)
        status, data = post_json(port, CHAT, chat())  # others are served meanwhile
        assert status == 200 and data["usage"]["completion_tokens"] == 2
        assert server.health()["status"] == "ok"
        grown = {name: round(peak[name] - before[name], 1) for name in pids}
        print(f"RSS before {before}, growth at the peak (MiB) {grown}")
        # 10 streams x ~50 KB of events: replies waiting in the inboxes and socket buffers.
        assert all(grown[name] < 100 for name in pids), grown
    finally:
        for sock in silent + slow:
            sock.close()
    stats = wait_idle(port, timeout=60)
    assert stats["live_requests"] == 0
    log = server.log()
    assert "Traceback" not in log, log[-4000:]
