"""The launcher's child management with stand-in children: ready reports, start-up failures
naming the child, health turning unhealthy and the watchdog firing when a child dies, and the
scheduler ranks' huge-page malloc (--huge-pages)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from minisgl.engine.config import EngineConfig
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


def report_malloc_pages(ready: ReadyReporter) -> None:
    """Reports GLIBC_TUNABLES and the huge-page KiB of a 16 MiB block from malloc, written through."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    size = 16 << 20
    address = libc.malloc(size)  # past the mmap threshold: a mapping of its own
    ctypes.memset(address, 1, size)
    huge_kib, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            huge_kib = int(line.split()[1])
    ready.ready(tunables=os.environ.get("GLIBC_TUNABLES", ""), huge_kib=huge_kib)
    while True:
        time.sleep(0.1)


def make(*specs, config: ServerConfig | None = None) -> ServiceProcesses:
    procs = ServiceProcesses(config or ServerConfig(), model_dir="unused", context_len=128)
    procs._specs = list(specs)
    return procs


def _thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.parametrize("huge_pages", [True, False])
def test_scheduler_ranks_start_with_huge_page_malloc(huge_pages: bool) -> None:
    config = ServerConfig(engine=EngineConfig(huge_pages=huge_pages))
    procs = make(("scheduler-0", report_malloc_pages, {}), ("tokenizer", report_malloc_pages, {}), config=config)
    procs.replica_of = {"scheduler-0": 0}
    try:
        procs.start()
        procs.wait_ready(60)
        scheduler, tokenizer = procs.info("scheduler-0"), procs.info("tokenizer")
    finally:
        procs.shutdown()
    assert "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", "")  # the launcher's own is as it was
    assert "glibc.malloc.hugetlb=1" not in tokenizer["tunables"]
    if not huge_pages:
        assert "glibc.malloc.hugetlb=1" not in scheduler["tunables"]
        return
    assert "glibc.malloc.hugetlb=1" in scheduler["tunables"].split(":")
    if _thp_mode() == "madvise":  # glibc madvised the block: part of it is in 2 MiB pages
        assert scheduler["huge_kib"] >= 2048 and tokenizer["huge_kib"] == 0, (scheduler, tokenizer)


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
