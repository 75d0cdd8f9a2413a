"""Two "nodes" on one machine: two launches with `--nnodes 2 --dist-init-addr 127.0.0.1:PORT`
(node ranks 0 and 1) on loopback form one TP=2 group over gloo. Node 0 runs the API server,
tokenizer, detokenizer and rank 0; node 1 runs only rank 1, which receives rank 0's messages over
TCP. Answers equal the offline TP=1 engine. Teardown follows node 0: a clean stop stops node 1
(exit 0), a killed node 0 makes node 1 leave (exit 1), and a dead rank on node 1 takes node 0,
and so the service, down."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.service import CPU_ARGS, REPO, Server, free_port, wait_idle
from tests.e2e.tp_models import check_openai_answers, make_served_model, offline_answers

pytestmark = pytest.mark.tp


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_model("llama", tmp_path_factory.mktemp("tiny_llama"))


class Node:
    """A launcher for a node other than 0 (no HTTP), its log in a file."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "minisgl", *CPU_ARGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pid(self, name: str) -> int:
        found = re.search(rf"started {name} \(pid (\d+)\)", self.log())
        assert found, self.log()
        return int(found.group(1))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self._log.close()


def _args(model: Path, dist_port: int, node_rank: int, num_pages: int = 64) -> list[str]:
    return ["--model", str(model), "--tp", "2", "--num-pages", str(num_pages), "--nnodes", "2",
            "--node-rank", str(node_rank), "--dist-init-addr", f"127.0.0.1:{dist_port}"]  # fmt: skip


@pytest.fixture
def two_nodes(tmp_path: Path, tiny_llama: Path) -> Iterator[tuple[Server, Node]]:
    dist_port = free_port()
    head = Server(tmp_path / "node0.log", *_args(tiny_llama, dist_port, 0))
    other = Node(tmp_path / "node1.log", *_args(tiny_llama, dist_port, 1))
    try:
        head.wait_ready()
        yield head, other
    finally:
        head.stop()
        other.stop()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_nodes_serve_like_tp1_and_stop_together(tmp_path: Path, tiny_llama: Path) -> None:
    expected: dict[str, Any] = offline_answers(tiny_llama)
    dist_port = free_port()
    head = Server(tmp_path / "node0.log", *_args(tiny_llama, dist_port, 0))
    other: Node | None = None
    try:
        # A node started with other settings is refused at once, naming the difference: a size, a
        # kernel switch, a scheduling switch.
        bad = subprocess.run([sys.executable, "-m", "minisgl", *CPU_ARGS,
                              *_args(tiny_llama, dist_port, 1, num_pages=32), "--no-pdl", "--no-overlap-schedule"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
        assert bad.returncode == 1, bad.stderr
        assert "settings differ from node 0's" in bad.stderr and "engine.num_pages: node 0 has 64" in bad.stderr
        assert "engine.kernels.pdl: node 0 has True, this node False" in bad.stderr
        assert "scheduler.overlap: node 0 has None, this node False" in bad.stderr
        other = Node(tmp_path / "node1.log", *_args(tiny_llama, dist_port, 1))
        head.wait_ready()
        assert set(head.child_pids()) == {"scheduler-0", "tokenizer", "detokenizer"}
        check_openai_answers(head.base_url, expected)
        wait_idle(head.port)
        rank1 = other.child_pid("scheduler-1")
        assert head.stop() == 0
        assert other.proc.wait(30) == 0, other.log()[-3000:]
        assert "node 0 stopped" in other.log()
        assert _gone(rank1)
    finally:
        head.stop()
        if other is not None:
            other.stop()


def test_killed_node0_makes_node1_leave(two_nodes: tuple[Server, Node]) -> None:
    head, other = two_nodes
    rank1 = other.child_pid("scheduler-1")
    os.killpg(head.proc.pid, signal.SIGKILL)
    assert other.proc.wait(30) == 1
    assert "lost node 0" in other.log()
    deadline = time.monotonic() + 10
    while not _gone(rank1):
        assert time.monotonic() < deadline, "node 1's rank outlived its launcher"
        time.sleep(0.1)


def test_dead_rank_on_node1_stops_the_service(two_nodes: tuple[Server, Node]) -> None:
    head, other = two_nodes
    os.kill(other.child_pid("scheduler-1"), signal.SIGKILL)
    assert other.proc.wait(30) == 1
    assert head.proc.wait(30) == 1
    assert "scheduler-1 on node 1" in head.log()
