"""Data parallelism: `--dp 2` engine replicas behind one API server, tokenizer and detokenizer.

The tokenizer sends each request to the replica with the fewest outstanding tokens, so requests
that overlap in time are spread over both replicas (visible in the per-replica counters of
/metrics); every answer equals the offline engine's; an abort (client disconnect, stop string)
reaches the replica that runs the request; a dead replica takes the service down. With `--tp 2`
as well, each replica is its own TP group (4 scheduler processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams
from tests.e2e.service import Server, get_json, parallel, request, start_server, wait_idle
from tests.e2e.tp_models import PROMPTS, check_openai_answers, make_served_model, offline_answers, openai_client

pytestmark = pytest.mark.tp

CONCURRENT = ["Count to ten:", "The capital of France is", "1, 2, 3, 4,", "Once upon a time", "Hello", "Why"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_model("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), device="cpu", num_pages=64)


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [r.outputs[0].text for r in llm.generate(prompts, params, use_tqdm=False)]


def replica_counters(port: int, name: str = "minisgl_replica_requests_total") -> dict[str, float]:
    status, raw = request(port, "GET", "/metrics")
    assert status == 200
    found = re.findall(rf'^{name}{{[^}}]*replica="(\d+)"[^}}]*}} (\S+)$', raw.decode(), re.M)
    return {replica: float(value) for replica, value in found}


def _replica_stats(port: int) -> list[dict[str, Any]]:
    status, stats = get_json(port, "/v1/internal/stats")
    assert status == 200, stats
    return list(stats["replicas"])


def _open_stream(port: int, body: dict[str, Any]) -> socket.socket:
    """A streaming request whose first chunk has arrived (so it runs in some replica)."""
    raw = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    assert b" 200 " in got.split(b"\r\n", 1)[0], got
    return sock


def _wait_for(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_dp2_spreads_requests_and_matches_offline(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path,
                                                  offline: LLM) -> None:  # fmt: skip
    expected = _greedy(offline, CONCURRENT)
    srv = start_server(tmp_path_factory, "dp2", "--model", str(tiny_llama), "--dp", "2", "--num-pages", "64")
    try:
        assert set(srv.child_pids()) == {"dp0-scheduler-0", "dp1-scheduler-0", "tokenizer", "detokenizer"}
        assert srv.health()["replicas"] == [{"replica": 0, "alive": True}, {"replica": 1, "alive": True}]
        client = openai_client(srv.base_url)

        def ask(prompt: str) -> Any:
            return lambda: client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0).choices[0].text  # fmt: skip

        assert parallel(*(ask(p) for p in CONCURRENT)) == expected
        counts = replica_counters(srv.port)
        assert sum(counts.values()) == len(CONCURRENT) and min(counts.values()) >= 1, counts
        assert set(counts) == {"0", "1"}
        _aborts_reach_their_replica(srv, offline)
        _dead_replica_stops_the_service(srv)
    finally:
        srv.stop()


def _aborts_reach_their_replica(srv: Server, offline: LLM) -> None:
    # A client disconnect: the first stream runs on replica 0, so the second goes to replica 1.
    long = {"model": "m", "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0}
    before = [r["aborted"] for r in _replica_stats(srv.port)]
    first = _open_stream(srv.port, long)
    second = _open_stream(srv.port, long)
    assert [r["running"] for r in _replica_stats(srv.port)] == [1, 1]
    first.close()
    second.close()
    _wait_for(lambda: [r["aborted"] for r in _replica_stats(srv.port)] == [n + 1 for n in before],
              "each replica to abort its request")  # fmt: skip
    wait_idle(srv.port, timeout=10)
    # A stop string: the detokenizer's abort goes through the tokenizer to the request's replica.
    # Two copies of one prompt in one request: routed to replica 0, then 1 (it holds nothing yet).
    text = _greedy(offline, [PROMPTS[0]], 12)[0]
    stop = text[4:8]
    before = [r["aborted"] for r in _replica_stats(srv.port)]
    body = openai_client(srv.base_url).completions.create(model="m", prompt=[PROMPTS[0]] * 2, max_tokens=900,
                                                          temperature=0, stop=[stop])  # fmt: skip
    assert [c.text for c in body.choices] == [text[: text.index(stop)]] * 2
    assert all(c.finish_reason == "stop" for c in body.choices)
    _wait_for(lambda: [r["aborted"] for r in _replica_stats(srv.port)] == [n + 1 for n in before],
              "each replica to stop its request")  # fmt: skip
    wait_idle(srv.port, timeout=10)


def _dead_replica_stops_the_service(srv: Server) -> None:
    os.kill(srv.child_pids()["dp1-scheduler-0"], signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    assert "the dp1-scheduler-0 process died" in srv.log()


def test_dp2_tp2_each_replica_its_own_group(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> None:
    expected = offline_answers(tiny_llama)
    srv = start_server(tmp_path_factory, "dp2tp2", "--model", str(tiny_llama), "--dp", "2", "--tp", "2",
                       "--num-pages", "64")  # fmt: skip
    try:
        assert set(srv.child_pids()) == {"dp0-scheduler-0", "dp0-scheduler-1", "dp1-scheduler-0",
                                         "dp1-scheduler-1", "tokenizer", "detokenizer"}  # fmt: skip
        check_openai_answers(srv.base_url, expected)
        counts = replica_counters(srv.port)
        # The batch of prompts alone alternates between the replicas.
        assert set(counts) == {"0", "1"} and min(counts.values()) >= 1, counts
        wait_idle(srv.port)
    finally:
        assert srv.stop() == 0
