"""A stopped scheduler (SIGSTOP) under --request-timeout, against the real server on CPU:
requests in flight and new ones end with an error at the deadline (504, or an error event once
streaming), the API server keeps answering, and after SIGCONT the scheduler catches up on the
aborts and the service works again with every page back.

(Workers killed under load are in test_reliability.py, TestDeadWorker.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from minisgl.bench.rawhttp import HttpReply, http_call
from tests.e2e.service import Server, get_json, post_json, start_server, wait_idle

TIMEOUT_S = 4
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stoppable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "stoppable", "--num-pages", "256", "--request-timeout", str(TIMEOUT_S))
    yield srv
    srv.stop()


def body(stream: bool, max_tokens: int = 4000) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "stream": stream, "max_tokens": max_tokens, "ignore_eos": True}).encode()  # fmt: skip


def error_of(reply: HttpReply) -> dict[str, Any]:
    if reply.status == 200:  # the stream had begun: an error event, then [DONE]
        assert reply.events[-1] == "[DONE]", reply.events[-3:]
        return dict(json.loads(reply.events[-2])["error"])
    assert reply.status == 504, (reply.status, reply.body[:200])
    return dict(json.loads(reply.body)["error"])


def test_stopped_scheduler_times_out_then_recovers(stoppable: Server) -> None:
    port = stoppable.port
    scheduler = stoppable.child_pids()["scheduler-0"]

    async def scenario() -> tuple[list[HttpReply], list[float], int]:
        start = time.monotonic()
        running = [asyncio.ensure_future(http_call("127.0.0.1", port, "POST", CHAT, body(s))) for s in (True, False)]
        while time.monotonic() - start < 3:  # stop once both decode (or stop anyway: they wait)
            _, stats = await asyncio.to_thread(get_json, port, "/v1/internal/stats")
            if stats.get("running") == 2:  # (a 503 when the scheduler is slow to answer)
                break
            await asyncio.sleep(0.05)
        os.kill(scheduler, signal.SIGSTOP)
        stopped = time.monotonic()
        late = asyncio.ensure_future(http_call("127.0.0.1", port, "POST", CHAT, body(False, 4)))
        health = await http_call("127.0.0.1", port, "GET", "/health")  # the API server still answers
        replies = await asyncio.wait_for(asyncio.gather(*running, late), 60)
        took = [time.monotonic() - stopped]
        return list(replies), took, health.status

    try:
        replies, took, health = asyncio.run(scenario())
        assert health == 200
        assert took[0] < TIMEOUT_S + 10, took
        for reply in replies:
            err = error_of(reply)
            assert err["code"] == "timeout" and f"{TIMEOUT_S} s" in err["message"], err
        status, stats = get_json(port, "/v1/internal/stats", timeout=30)  # the scheduler cannot answer
        assert status == 503 and "did not answer" in stats["error"]["message"], stats
    finally:
        os.kill(scheduler, signal.SIGCONT)
    stats = wait_idle(port, timeout=60)  # the aborts queued while it was stopped free every page
    assert stats["live_requests"] == 0
    status, data = post_json(port, "/v1/completions", {"model": "m", "prompt": "1, 2,", "max_tokens": 3})
    assert status == 200 and data["usage"]["completion_tokens"] == 3, data
    assert stoppable.health()["status"] == "ok"
    log = stoppable.log()
    assert "Traceback" not in log, log[-4000:]
