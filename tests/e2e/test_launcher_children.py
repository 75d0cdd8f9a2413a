"""The launcher's child management with stand-in children: ready reports, start-up failures
naming the child, health turning unhealthy and the watchdog firing when a child dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from minisgl.server.args import ServerConfig
from minisgl.server.launch import ServiceProcesses, StartupError
from minisgl.utils.process import ReadyReporter


def serve_forever(ready: ReadyReporter, info: int = 0) -> None:
    ready.ready(value=info)
    while True:
        time.sleep(0.1)


def fail_at_start(ready: ReadyReporter) -> None:
    raise ValueError("bad option --foo; use --bar")


def exit_silently(ready: ReadyReporter) -> None:
    os._exit(3)


def never_ready(ready: ReadyReporter) -> None:
    time.sleep(60)


def make(*specs) -> ServiceProcesses:
    procs = ServiceProcesses(ServerConfig(), model_dir="unused", context_len=128)
    procs._specs = list(specs)
    return procs


def test_ready_health_and_watchdog():
    procs = make(("alpha", serve_forever, {"info": 7}), ("beta", serve_forever, {}))
    try:
        procs.start()
        procs.wait_ready(60)
        assert procs.info("alpha") == {"value": 7}
        ok, details = procs.health()
        assert ok and set(details["children"]) == {"alpha", "beta"}
        died: list[str] = []
        fired = threading.Event()
        procs.start_watchdog(lambda name: (died.append(name), fired.set()))
        os.kill(details["children"]["beta"]["pid"], signal.SIGKILL)
        assert fired.wait(10) and died == ["beta"]
        ok, details = procs.health()
        assert not ok and details["children"]["beta"]["alive"] is False
    finally:
        procs.shutdown()
    assert all(not c.process.is_alive() for c in procs.children)
    assert not os.path.exists(procs.ipc.path)


@pytest.mark.parametrize(
    "target, needle",
    [(fail_at_start, "gamma failed to start: ValueError: bad option --foo; use --bar"),
     (exit_silently, "gamma exited with code 3")],
)  # fmt: skip
def test_startup_failure_names_the_child(target, needle):
    procs = make(("ok", serve_forever, {}), ("gamma", target, {}))
    try:
        procs.start()
        with pytest.raises(StartupError, match=needle):
            procs.wait_ready(60)
    finally:
        procs.shutdown()
    assert all(not c.process.is_alive() for c in procs.children)


def test_startup_timeout_names_the_slow_child():
    procs = make(("slowpoke", never_ready, {}))
    try:
        procs.start()
        with pytest.raises(StartupError, match="slowpoke"):
            procs.wait_ready(3)
    finally:
        t0 = time.monotonic()
        procs.shutdown()
        assert time.monotonic() - t0 < 5  # SIGTERM is honoured even while the child sleeps
    assert not procs.children[0].process.is_alive()
