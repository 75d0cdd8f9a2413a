"""Process lifecycle: two services side by side, clean SIGTERM, a crashed child brings the service
down (non-zero, no orphans), waiting requests abort on disconnect, bad options fail in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.service import REPO, Server, get_json, post_json, wait_idle

psutil = pytest.importorskip("psutil")

LONG = {"model": "m", "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
        "max_tokens": 2000, "temperature": 0, "ignore_eos": True}  # fmt: skip


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def stats(srv: Server) -> dict:
    """Scheduler stats; {} while the scheduler is too busy to answer in time (a 503), so the
    polling loops below read that as "not yet" rather than failing on a loaded machine."""
    status, body = get_json(srv.port, "/v1/internal/stats")
    return body if status == 200 else {}


def open_request(port: int, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    return sock


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    # Started together so their start-up overlaps; the second has one running slot, a small pool.
    a = Server(tmp_path_factory.mktemp("a") / "server.log")
    b = Server(tmp_path_factory.mktemp("b") / "server.log", "--max-running-requests", "1", "--num-pages", "160")
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_two_services_at_once(two_servers):
    a, b = two_servers
    assert a.port != b.port
    body = {"model": "m", "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}
    ra = post_json(a.port, "/v1/completions", body)
    rb = post_json(b.port, "/v1/completions", body)
    assert ra[0] == rb[0] == 200
    assert ra[1]["choices"][0]["text"] == rb[1]["choices"][0]["text"]
    assert set(a.child_pids().values()).isdisjoint(b.child_pids().values())


def test_small_pool_limits_max_tokens(two_servers):
    _, srv = two_servers  # 160 pages of 16 tokens
    chat = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0, "stop": ["."]}
    status, body = post_json(srv.port, "/v1/chat/completions", chat)  # no max_tokens: fits the pool
    assert status == 200, body
    status, body = post_json(srv.port, "/v1/chat/completions", {**chat, "max_tokens": 4000})
    assert status == 400 and "--num-pages" in body["error"]["message"], body


def test_disconnect_while_waiting_aborts(two_servers):
    _, srv = two_servers  # --max-running-requests 1: the second request waits
    first = open_request(srv.port, LONG)
    assert wait_until(lambda: stats(srv).get("running") == 1, 60)
    second = open_request(srv.port, LONG)
    assert wait_until(lambda: stats(srv).get("waiting") == 1, 60)
    second.close()
    assert wait_until(lambda: stats(srv).get("waiting") == 0 and stats(srv).get("live_requests") == 1, 30)
    first.close()
    wait_idle(srv.port)
    assert srv.log().count("Aborting request") >= 4  # both requests, by the server and the scheduler


def test_sigterm_stops_everything(two_servers):
    a, _ = two_servers
    pids = list(a.child_pids().values())
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(15) == 0
    assert wait_until(lambda: all(gone(p) for p in pids), 5), a.log()[-2000:]


def test_killed_scheduler_brings_service_down(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("crash") / "server.log")
    try:
        srv.wait_ready()
        pids = srv.child_pids()
        inflight = open_request(srv.port, LONG)  # a request running when the scheduler dies
        assert wait_until(lambda: stats(srv).get("running") == 1, 60)
        os.kill(pids["scheduler-0"], signal.SIGKILL)
        t0 = time.monotonic()
        reply = b""
        while chunk := inflight.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 503"), reply  # failed promptly, not left hanging
        code = srv.proc.wait(10)
        assert code != 0
        assert time.monotonic() - t0 < 10
        assert wait_until(lambda: all(gone(p) for p in pids.values()), 3)
        log = srv.log()
        assert "scheduler-0" in log and "died" in log
    finally:
        srv.stop()


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minisgl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)  # fmt: skip


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--port", "abc"], "--port"),
        (["--num-pages", "0"], "--num-pages"),
        (["--num-pages", "10", "--kv-cache-gb", "1"], "--kv-cache-gb"),
        (["--device", "tpu"], "device"),
        (["--cache", "lru"], "--cache"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_bad_option_is_one_line(args, needle):
    res = _run_cli(*args)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_help_is_complete():
    res = _run_cli("--help")
    assert res.returncode == 0
    for opt in ("--model", "--host", "--port", "--device", "--dtype", "--tp", "--page-size", "--num-pages",
                "--kv-cache-gb", "--max-running-requests", "--max-prefill-tokens", "--cache", "--attn",
                "--dummy-weights", "--shell"):  # fmt: skip
        assert opt in res.stdout


def test_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        res = _run_cli("--device", "cpu", "--port", str(s.getsockname()[1]))
    assert res.returncode != 0 and "--port" in res.stderr and "Traceback" not in res.stderr
