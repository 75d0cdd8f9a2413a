"""Reliability under load, overload, faults and bad input, against the real server on CPU.

- a reduced stress round (200 concurrent streams, 50 cut at random points, 50 bad requests):
  every uncut stream gets exactly its tokens, no 5xx, nothing hangs, every page comes back;
- requests too large for the model or the pool are refused (400), never crash the scheduler;
- overload: beyond running capacity + --max-queued-requests, 503 at once with Retry-After;
- --request-timeout ends streaming and plain requests with an error and frees their pages;
- SIGTERM drains: 503 for new requests, in-flight ones finish, the rest end with an error, exit 0;
- SIGKILL of each worker kind while three requests stream: they end with an error, /health fails
  within 5 s, the launcher exits non-zero, no child left.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from minisgl.bench.rawhttp import HttpError, HttpReply, http_call
from minisgl.bench.stress import StressConfig, format_round, run_stress, valid_body
from tests.e2e.service import REPO, Server, get_json, post_json, start_server, wait_idle

psutil = pytest.importorskip("psutil")

LONG_TOKENS = 4000  # far more than a CPU decodes before any deadline below


def events(reply: HttpReply) -> list[dict[str, Any]]:
    return [json.loads(e) for e in reply.events if e != "[DONE]"]


def completion_tokens(reply: HttpReply) -> int | None:
    usage = [e["usage"] for e in events(reply) if e.get("usage")]
    return usage[-1]["completion_tokens"] if usage else None


def long_body(stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": stream,
            "max_tokens": LONG_TOKENS, "ignore_eos": True}  # fmt: skip


def sse_status(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    reply = asyncio.run(asyncio.wait_for(http_call("127.0.0.1", port, "POST", path, json.dumps(body).encode()), 120))
    return reply.status, reply.events or reply.body


def wait_until(cond: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


def no_traceback(srv: Server) -> None:
    log = srv.log()
    assert "Traceback" not in log, log[-4000:]


# ------------------------------------------------------------------------------------ stress


def test_stress_round(tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = start_server(tmp_path_factory, "stress", "--num-pages", "1024")
    try:
        cfg = StressConfig("127.0.0.1", srv.port, concurrency=200, disconnects=50, invalid=50, rounds=1,
                           max_tokens=8, seed=1, timeout=240, idle_timeout=30)  # fmt: skip
        (rep,) = asyncio.run(run_stress(cfg))
        summary = format_round(rep)
        assert rep.ok, summary
        assert (rep.completed, rep.cut, rep.failed, rep.server_errors, rep.hung) == (150, 50, 0, 0, 0), summary
        assert rep.invalid_rejected == 50
        assert rep.live_requests == 0 and rep.free_pages + rep.evictable_pages == rep.total_pages
        no_traceback(srv)
    finally:
        srv.stop()


# ------------------------------------------------------------- large requests, overload, timeout


@pytest.fixture(scope="class")
def bounded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "bounded", "--num-pages", "256", "--max-running-requests", "8",
                       "--max-queued-requests", "8")  # fmt: skip
    yield srv
    srv.stop()


class TestBoundedServer:
    """One server: 8 running + 8 queued requests, a 4096-token pool."""

    @pytest.mark.parametrize(
        "path, body",
        [
            ("/v1/completions", {"prompt": "x", "max_tokens": 2**63 - 1}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 8000}),  # fits the context, not the pool (4096)
            ("/v1/completions", {"prompt": list(range(20000)), "max_tokens": 1}),
            ("/v1/completions", {"prompt": "word " * 200_000, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1_000_000}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 64, "max_tokens": 8000}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 10**9}),
            ("/generate", {"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 1}}),
            ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**12}}),
        ],
        ids=["max-int64", "beyond-int64", "beyond-pool", "20k-ids", "1M-chars", "1M-message", "n64-beyond-pool",
             "min-tokens", "generate-9k-ids", "generate-huge-max"],
    )  # fmt: skip
    def test_huge_requests_are_refused(self, bounded_server: Server, path: str, body: dict[str, Any]) -> None:
        status, data = post_json(bounded_server.port, path, {"model": "m", **body}, timeout=60)
        assert status == 400, (status, data)
        assert data["error"]["message"]
        assert bounded_server.health()["status"] == "ok"
        wait_idle(bounded_server.port, timeout=30)


    def test_every_ending_gives_pages_and_reply_state_back(self, bounded_server: Server) -> None:
        """Stop string (ended by the detokenizer), stop token, EOS or length, a refusal after the
        tokenizer, n > 1 where one choice is refused: all leave the server idle with every page
        free or evictable and no reply state."""
        port = bounded_server.port
        count = {"model": "m", "prompt": "1, 2, 3, 4,", "temperature": 0}
        cases = [
            ("/v1/completions", {**count, "max_tokens": 20, "stop": [","]}),
            ("/v1/completions", {**count, "max_tokens": 20, "stop": [","], "stream": True}),
            ("/v1/completions", {**count, "max_tokens": 20, "stop_token_ids": [28]}),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Say hi."}],
                                      "max_tokens": 24, "temperature": 0}),
            ("/v1/completions", {**count, "prompt": "x " * 5000, "max_tokens": 4}),  # refused by the tokenizer
            ("/v1/completions", {**count, "prompt": ["1, 2,", "x " * 5000], "max_tokens": 4}),  # one of two
        ]  # fmt: skip
        for path, body in cases:
            status, data = (sse_status(port, path, body) if body.get("stream") else post_json(port, path, body))
            assert status in (200, 400), (path, body, status, data)
        wait_idle(port, timeout=30)

    def test_overload_gets_503_at_once(self, bounded_server: Server) -> None:
        max_tokens, total, admitted = 4, 64, 8 + 8

        async def one(i: int) -> tuple[HttpReply, float]:
            path, body = valid_body(i, max_tokens, chat=i % 2 == 0)
            start = time.monotonic()
            reply = await asyncio.wait_for(http_call("127.0.0.1", bounded_server.port, "POST", path, body), 120)
            return reply, time.monotonic() - start

        async def burst() -> list[tuple[HttpReply, float]]:
            return list(await asyncio.gather(*(one(i) for i in range(total))))

        results = asyncio.run(burst())
        ok = [r for r, _ in results if r.status == 200]
        refused = [(r, t) for r, t in results if r.status == 503]
        assert len(ok) + len(refused) == total, [r.status for r, _ in results]
        # All 64 arrive while the first 16 run; a few more may slip in if some finish early.
        assert admitted <= len(ok) <= admitted + 8 and len(refused) >= total - admitted - 8
        for reply, took in refused:
            assert took < 5.0
            assert reply.headers.get("retry-after") == "1"
            err = json.loads(reply.body)["error"]
            assert set(err) == {"message", "type", "param", "code"} and "overloaded" in err["message"]
        for reply in ok:
            assert reply.events[-1] == "[DONE]" and completion_tokens(reply) == max_tokens
        wait_idle(bounded_server.port, timeout=30)


# -------------------------------------------------------------------------------- timeout, drain


@pytest.fixture(scope="module")
def short_lived(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Two servers started together (their start-up overlaps), each ended by SIGTERM in a test:
    one with a 5 s request timeout and a 1 s shutdown timeout, one with a 60 s shutdown timeout."""
    servers = {
        "timeout": Server(tmp_path_factory.mktemp("timeout") / "server.log", "--num-pages", "256",
                          "--request-timeout", "5", "--shutdown-timeout", "1"),
        "drain": Server(tmp_path_factory.mktemp("drain") / "server.log", "--num-pages", "256",
                        "--shutdown-timeout", "60"),
    }  # fmt: skip
    try:
        for srv in servers.values():
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def test_request_timeout_ends_and_frees(short_lived: dict[str, Server]) -> None:
    srv = short_lived["timeout"]

    async def both() -> tuple[HttpReply, HttpReply]:
        port = srv.port
        streamed = http_call("127.0.0.1", port, "POST", "/v1/chat/completions", json.dumps(long_body(True)).encode())
        plain = http_call("127.0.0.1", port, "POST", "/v1/chat/completions", json.dumps(long_body(False)).encode())
        a, b = await asyncio.wait_for(asyncio.gather(streamed, plain), 60)
        return a, b

    start = time.monotonic()
    streamed, plain = asyncio.run(both())
    took = time.monotonic() - start
    assert 4.5 < took < 20, took
    if streamed.status == 200:  # the stream began: it ends with an error event, then [DONE]
        assert streamed.events[-1] == "[DONE]"
        err = events(streamed)[-1]["error"]
    else:  # a machine too busy to compute the prompt in 5 s: nothing was streamed yet
        assert streamed.status == 504
        err = json.loads(streamed.body)["error"]
    assert err["code"] == "timeout" and "5 s" in err["message"]
    assert plain.status == 504
    assert json.loads(plain.body)["error"]["type"] == "timeout_error"
    stats = wait_idle(srv.port, timeout=30)  # both aborted: pages back, reply state gone
    assert stats["live_requests"] == 0
    assert srv.log().count("Aborting request") >= 4  # by the API server and the scheduler
    no_traceback(srv)


def test_sigterm_drains(short_lived: dict[str, Server]) -> None:
    """In-flight requests finish, new ones get 503, and the launcher exits 0 as soon as they are
    done (well before the 60 s shutdown timeout)."""
    srv = short_lived["drain"]
    family = [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]
    short_tokens, port = 16, srv.port

    async def post(path: str, body: bytes) -> HttpReply:
        return await http_call("127.0.0.1", port, "POST", path, body)

    async def scenario() -> tuple[list[HttpReply], HttpReply, HttpReply, float]:
        shorts = [asyncio.ensure_future(post(*valid_body(i, short_tokens, chat=True))) for i in range(2)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # signal once both run in the scheduler
            _, stats = await asyncio.to_thread(get_json, port, "/v1/internal/stats")
            if stats["running"] == 2:
                break
            await asyncio.sleep(0.02)
        os.kill(srv.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.2)
        refused = await post(*valid_body(99, 2, chat=True))
        health = await http_call("127.0.0.1", port, "GET", "/health")
        done = await asyncio.wait_for(asyncio.gather(*shorts), 120)
        return list(done), refused, health, signalled

    done, refused, health, signalled = asyncio.run(scenario())
    assert refused.status == 503 and "shutting down" in json.loads(refused.body)["error"]["message"]
    assert refused.headers.get("retry-after") == "1"
    assert health.status == 503 and json.loads(health.body)["status"] == "draining"
    for reply in done:  # in flight when the signal came: finished in full
        assert reply.status == 200 and completion_tokens(reply) == short_tokens, reply.events[-3:]
    assert srv.proc.wait(60) == 0
    assert time.monotonic() - signalled < 50
    assert wait_until(lambda: all(_zombie(p) for p in family), 10), [p for p in family if not _zombie(p)]


def test_sigterm_ends_what_outlives_the_drain(short_lived: dict[str, Server]) -> None:
    """Past --shutdown-timeout (1 s on this server) a running request ends with an error event."""
    srv = short_lived["timeout"]
    family = [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]

    async def scenario() -> tuple[HttpReply, float]:
        body = json.dumps(long_body(True)).encode()
        running = asyncio.ensure_future(http_call("127.0.0.1", srv.port, "POST", "/v1/chat/completions", body))
        await asyncio.sleep(0.5)
        os.kill(srv.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        reply = await asyncio.wait_for(running, 60)
        return reply, time.monotonic() - signalled

    reply, took = asyncio.run(scenario())
    assert 0.9 < took < 4, took  # before its own 5 s request timeout
    if reply.status == 200:
        assert reply.events[-1] == "[DONE]"
        err = events(reply)[-1]["error"]
    else:  # nothing streamed yet on a busy machine
        assert reply.status == 503
        err = json.loads(reply.body)["error"]
    assert "shut down" in err["message"] and err["code"] == "service_unavailable"
    assert srv.proc.wait(30) == 0
    assert wait_until(lambda: all(_zombie(p) for p in family), 10), [p for p in family if not _zombie(p)]


def _zombie(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


# ------------------------------------------------------------------------------ dead workers

WORKERS = ["scheduler-0", "tokenizer", "detokenizer"]


@pytest.fixture(scope="class")
def doomed_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    # Started together so their start-up overlaps; each loses one worker.
    servers = {w: Server(tmp_path_factory.mktemp(w) / "server.log", "--num-pages", "256") for w in WORKERS}
    try:
        for srv in servers.values():
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def _health_fails(port: int) -> bool:
    try:
        status, _ = get_json(port, "/health", timeout=1)
    except (OSError, ValueError, http.client.HTTPException):
        return True
    return status != 200


class TestDeadWorker:
    """Three servers started together; each loses one worker to SIGKILL while it streams."""

    @pytest.mark.parametrize("worker", WORKERS)
    def test_killed_worker_stops_service(self, doomed_servers: dict[str, Server], worker: str) -> None:
        srv = doomed_servers[worker]
        family = [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]
        victim = srv.child_pids()[worker]
        assert victim in family

        async def scenario() -> tuple[list[HttpReply | BaseException], float]:
            body = json.dumps(long_body(True)).encode()
            streams = [asyncio.ensure_future(http_call("127.0.0.1", srv.port, "POST", "/v1/chat/completions", body))
                       for _ in range(3)]  # fmt: skip
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # kill once all three are decoding
                _, stats = await asyncio.to_thread(get_json, srv.port, "/v1/internal/stats")
                if stats["running"] == 3:
                    break
                await asyncio.sleep(0.05)
            assert stats["running"] == 3, stats
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            failing = await asyncio.to_thread(wait_until, lambda: _health_fails(srv.port), 5.0, 0.05)
            assert failing, f"/health still ok after killing {worker}"
            took = time.monotonic() - killed
            ended = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
            return list(ended), took

        ended, took = asyncio.run(scenario())
        assert took <= 5.5
        for reply in ended:  # in flight: ended with an error (or the connection closed), never completed
            if isinstance(reply, BaseException):
                assert isinstance(reply, (HttpError, OSError)), repr(reply)
                continue
            assert reply.status == 200 or reply.status >= 500, reply.status
            if reply.status == 200:
                payloads = events(reply)
                assert completion_tokens(reply) != LONG_TOKENS
                if reply.events and reply.events[-1] == "[DONE]":
                    assert "error" in payloads[-1], payloads[-1:]
        code = srv.proc.wait(20)
        assert code != 0
        assert wait_until(lambda: all(_zombie(p) for p in family), 10), [p for p in family if not _zombie(p)]
        assert worker in srv.log() and "died" in srv.log()


# ------------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    "args",
    [["--max-queued-requests", "-1"], ["--max-queued-requests", "many"], ["--request-timeout", "0"],
     ["--request-timeout", "soon"], ["--shutdown-timeout", "-5"], ["--shutdown-timeout", "inf"]],
)  # fmt: skip
def test_bad_reliability_option_is_one_line(args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", "minisgl", *args], capture_output=True, text=True, timeout=120,
                         cwd=REPO)  # fmt: skip
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and args[0] in lines[0], res.stderr
