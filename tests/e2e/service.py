"""Helpers for end-to-end tests: the real `python -m minisgl --device cpu` on a free loopback port,
and small raw-HTTP clients (for what the official client hides: SSE framing, bad bodies, disconnects)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

STARTUP_TIMEOUT = 300.0
REPO = Path(__file__).resolve().parents[2]
# The suite's exactness checks are stated for fp32 (tests/conftest.py pins the in-process engines);
# a test's own --dtype, later on the command line, wins.
CPU_ARGS = ("--device", "cpu", "--dtype", "float32")
# What `python -m minisgl --device cpu` serves: the embedded GGUF with its blocks kept quantized,
# fp32 activations on the C++ kernels (~6x the fp32 exact mode's decode speed on 2 cores: 7.5
# against 44 ms a token on a Zen 5). The shared servers that answer the API tests run it
# (tests/conftest.py `server`, tests/e2e/conftest.py), compared with the offline engine in the same
# mode (`served_offline`); the golden tests hold it to the fp32 model (test_embedded_quantized.py).
DEFAULT_ARGS = ("--device", "cpu")
# The keyed server (tests/e2e/conftest.py: keyed_server), shared by the modules that test access,
# CORS, the Anthropic and Responses APIs and the chat page: one key, one allowed origin, a store of
# 3 responses (what test_responses_api.py's LRU check counts on).
API_KEY = "sk-e2e-test"
CORS_ORIGIN = "http://example.com"
KEYED_ARGS = ("--api-key", API_KEY, "--cors-origins", CORS_ORIGIN, "--max-stored-responses", "3")
# The small-context server shared by test_openapi.py and test_fuzz.py (generated bodies stay cheap).
SMALL_CONTEXT_ARGS = ("--max-model-len", "64", "--num-pages", "256")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A launcher subprocess in its own session, its log in a file."""

    def __init__(self, log_path: Path, *extra: str, base: tuple[str, ...] = CPU_ARGS) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "minisgl", *base, "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        self.base_url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                status, _ = get_json(self.port, "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()[-4000:]}")

    def health(self) -> dict[str, Any]:
        return get_json(self.port, "/health")[1]

    def child_pids(self) -> dict[str, int]:
        return {name: c["pid"] for name, c in self.health()["children"].items()}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        try:  # anything left in its session (should be nothing)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode


def request(port: int, method: str, path: str, body: bytes | None = None,
            timeout: float = 120) -> tuple[int, bytes]:  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get_json(port: int, path: str, timeout: float = 30) -> tuple[int, Any]:
    status, data = request(port, "GET", path, timeout=timeout)
    return status, json.loads(data)


def post_json(port: int, path: str, body: Any, timeout: float = 120) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, data = request(port, "POST", path, raw, timeout=timeout)
    return status, json.loads(data)


def sse_lines(port: int, path: str, body: Any, timeout: float = 120) -> list[str]:
    """POST with stream=true; every non-empty line of the event stream, in order."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        raw = resp.read().decode()
    finally:
        conn.close()
    assert raw.endswith("\n\n")
    return [line for line in raw.split("\n") if line]


def wait_idle(port: int, timeout: float = 30) -> dict[str, Any]:
    """Stats once nothing runs, waits or is live, and every page is free or evictable."""
    deadline = time.monotonic() + timeout
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, stats = get_json(port, "/v1/internal/stats")
        idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["live_requests"] == 0
        if idle and stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]:
            return stats
        time.sleep(0.2)
    raise AssertionError(f"server not idle with all pages back: {stats}")


def start_server(tmp_path_factory: pytest.TempPathFactory, name: str, *extra: str,
                 base: tuple[str, ...] = CPU_ARGS) -> Server:  # fmt: skip
    server = Server(tmp_path_factory.mktemp(name) / "server.log", *extra, base=base)
    try:
        server.wait_ready()
    except Exception:
        server.stop()
        raise
    return server


def parallel(*calls: Any) -> list[Any]:
    """Run zero-argument callables at once (the server batches them: one decode for all)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda fn: fn(), calls))
