"""The children of one launch: which processes run on this node, start, ready, watch, tear down.

Processes (all spawned, so none inherits the launcher's threads, sockets or a device context):
`--tp` scheduler ranks for each of the `--dp` replicas (with `--nnodes`, this node's share of
each replica's ranks), and on node 0 a tokenizer and a detokenizer. A watchdog thread waits on
every child; if one dies the whole service goes down with its name in the log. Children also exit
by themselves when the launcher disappears.

Addresses are made per launch: ipc paths in a fresh directory for everything on this node, and
for ranks on other nodes `tcp://IP:*` (a free port, published through the rendezvous store).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator, Mapping

from minisgl.scheduler.process import SchedulerAddrs, run_scheduler
from minisgl.server.args import ServerConfig
from minisgl.server.cluster import Cluster
from minisgl.server.frontend import FrontendAddrs
from minisgl.tokenizer.detokenizer import DetokenizerAddrs, run_detokenizer
from minisgl.tokenizer.worker import TokenizerAddrs, run_tokenizer
from minisgl.utils.logging import get_logger
from minisgl.utils.memory import huge_page_environment
from minisgl.utils.process import child_main
from minisgl.utils.zmq import IpcDir

logger = get_logger(__name__)

Spec = tuple[str, Callable[..., None], dict[str, Any]]


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: BaseProcess
    conn: Connection  # the launcher's end of the start-up pipe
    info: dict[str, Any] | None = None


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `values` set inside (what a child spawned inside inherits), as before after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def scheduler_name(replica: int, rank: int, dp_size: int) -> str:
    return f"scheduler-{rank}" if dp_size == 1 else f"dp{replica}-scheduler-{rank}"


class ServiceProcesses:
    """Owns the children of one launch on this node."""

    def __init__(self, config: ServerConfig, model_dir: str, context_len: int, cluster: Cluster | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.ipc = IpcDir()
        self.replica_of: dict[str, int] = {}  # scheduler child -> its replica
        self._specs: list[Spec] = []
        dp = config.parallel.dp_size
        a = {name: self.ipc.addr(name) for name in ("tokenizer", "detokenizer", "frontend")}
        heads = tuple(self.ipc.addr(f"scheduler-{d}") for d in range(dp))  # rank 0 of each replica
        self.frontend_addrs = FrontendAddrs(recv=a["frontend"], tokenizer=a["tokenizer"], scheduler=heads[0],
                                            other_replicas=heads[1:])  # fmt: skip
        # Replicas tell the tokenizer their limits at start-up, and which requests ended only
        # when its router has a choice.
        sched = SchedulerAddrs(recv="", detokenizer=a["detokenizer"], frontend=a["frontend"],
                               router=a["tokenizer"] if dp > 1 else None, tokenizer=a["tokenizer"])  # fmt: skip
        self._add_schedulers(model_dir, sched, heads)
        if config.parallel.is_head:
            tok = TokenizerAddrs(recv=a["tokenizer"], schedulers=heads, frontend=a["frontend"])
            self._specs.append(("tokenizer", run_tokenizer, dict(model_dir=model_dir, context_len=context_len,
                                                                 addrs=tok, reasoning_parser=config.reasoning_parser)))  # fmt: skip
            # Stop-string aborts go straight to rank 0 of the request's replica.
            detok = DetokenizerAddrs(recv=a["detokenizer"], schedulers=heads, frontend=a["frontend"])
            self._specs.append(("detokenizer", run_detokenizer, dict(model_dir=model_dir, addrs=detok)))
        self.children: list[Child] = []
        # The shell keeps the terminal for the conversation: workers only log warnings there.
        self.log_level: str | None = "WARNING" if config.shell else None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def _add_schedulers(self, model_dir: str, sched: SchedulerAddrs, heads: tuple[str, ...]) -> None:
        config, parallel = self.config, self.config.parallel
        tp = config.engine.tp_size
        per_node = tp // parallel.nnodes
        local_ranks = range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)
        # A GGUF stays named by its file: the engine keeps its blocks (--weights gguf) from it.
        engine = config.engine if config.engine.gguf_model else replace(config.engine, model=model_dir)
        for replica in range(parallel.dp_size):
            rdzv = None
            if tp > 1:
                assert self.cluster is not None, "tensor parallelism needs the rendezvous store"
                rdzv = self.cluster.rendezvous(replica)
            for index, rank in enumerate(local_ranks):
                if rank == 0:
                    recv = heads[replica]
                elif parallel.is_head:
                    recv = self.ipc.addr(f"relay-{replica}-{rank}")
                else:
                    assert self.cluster is not None
                    recv = self.cluster.rank_address()
                name = scheduler_name(replica, rank, parallel.dp_size)
                kwargs = dict(engine_config=replace(engine, tp_rank=rank), sched_config=config.sched,
                              addrs=replace(sched, recv=recv), rdzv=rdzv,
                              device_index=replica * per_node + index)  # fmt: skip
                self._specs.append((name, run_scheduler, kwargs))
                self.replica_of[name] = replica

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        # Scheduler ranks (--huge-pages): malloc's large blocks in transparent huge pages, a
        # setting glibc reads only when a process starts (utils/memory.huge_page_environment).
        huge = huge_page_environment(os.environ) if self.config.engine.huge_pages else {}
        for name, target, kwargs in self._specs:
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child_main, args=(name, child_end, target, kwargs, self.log_level),
                               name=f"minisgl-{name}")  # fmt: skip
            with _environment(huge if name in self.replica_of else {}):
                proc.start()
            child_end.close()
            self.children.append(Child(name, proc, parent_end))
            logger.info("started %s (pid %d)", name, proc.pid)

    def wait_ready(self, timeout: float, poll: Callable[[], str | None] | None = None) -> None:
        """Wait for every child's ready report; `poll` names a failure elsewhere (another node)."""
        deadline = time.monotonic() + timeout
        pending = {c.name: c for c in self.children}
        while pending:
            remote = poll() if poll is not None else None
            if remote is not None:
                raise StartupError(remote)
            left = deadline - time.monotonic()
            if left <= 0:
                hint = "raise --startup-timeout if the model is slow to load"
                if self.config.parallel.nnodes > 1:
                    hint = f"is every one of the --nnodes {self.config.parallel.nnodes} nodes started? " + hint
                raise StartupError(f"timed out after {timeout:.0f} s waiting for {', '.join(pending)} to start "
                                   f"({hint})")  # fmt: skip
            handles: list[Any] = [c.conn for c in pending.values()] + [c.process.sentinel for c in pending.values()]
            ready = wait(handles, timeout=min(left, 1.0))
            for child in list(pending.values()):
                if child.conn in ready or child.process.sentinel in ready:
                    report = self._read_report(child)
                    if report is None:
                        child.process.join(1.0)
                        raise StartupError(f"{child.name} exited with code {child.process.exitcode} during start-up")
                    kind, payload = report
                    if kind == "error":
                        raise StartupError(f"{child.name} failed to start: {payload}")
                    child.info = payload
                    del pending[child.name]
                    logger.info("%s is ready", child.name)

    @staticmethod
    def _read_report(child: Child) -> tuple[str, Any] | None:
        try:
            if child.conn.poll(0.2):
                kind, payload = child.conn.recv()
                return kind, payload
        except (EOFError, OSError):
            pass
        return None

    def info(self, name: str) -> dict[str, Any]:
        return next(c.info or {} for c in self.children if c.name == name)

    # ------------------------------------------------------------------ running
    def health(self) -> tuple[bool, dict[str, Any]]:
        children = {c.name: {"pid": c.process.pid, "alive": c.process.is_alive()} for c in self.children}
        replicas = [{"replica": d, "alive": all(children[n]["alive"] for n, r in self.replica_of.items()
                                                if r == d and n in children)}
                    for d in range(self.config.parallel.dp_size)]  # fmt: skip
        details = {"pid": os.getpid(), "children": children, "replicas": replicas}
        return all(v["alive"] for v in children.values()), details

    def start_watchdog(self, on_death: Callable[[str], None], poll: Callable[[], str | None] | None = None) -> None:
        """Call `on_death(name)` once, when a child dies or `poll` (asked twice a second) names
        something else that did (a rank on another node)."""

        def watch() -> None:
            sentinels = {c.process.sentinel: c for c in self.children}
            while True:
                ready = wait(list(sentinels), timeout=None if poll is None else 0.5)
                if self._stopping.is_set():
                    return
                if ready:
                    dead = sentinels[ready[0]]  # type: ignore[index]
                    dead.process.join(0.5)
                    logger.error("child process %s (pid %s) died unexpectedly with exit code %s; shutting the "
                                 "service down", dead.name, dead.process.pid, dead.process.exitcode)  # fmt: skip
                    on_death(dead.name)
                    return
                remote = poll() if poll is not None else None
                if remote is not None and not self._stopping.is_set():
                    logger.error("%s died; shutting the service down", remote)
                    on_death(remote)
                    return

        threading.Thread(target=watch, name="watchdog", daemon=True).start()

    def wait_any_exit(self, timeout: float) -> Child | None:
        """The first child found dead within `timeout` s (None: all alive)."""
        sentinels = {c.process.sentinel: c for c in self.children}
        ready = wait(list(sentinels), timeout=timeout)
        return sentinels[ready[0]] if ready else None  # type: ignore[index]

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, grace: float = 3.0) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            for c in self.children:
                if c.process.is_alive():
                    c.process.terminate()
            deadline = time.monotonic() + grace
            for c in self.children:
                c.process.join(max(0.0, deadline - time.monotonic()))
            for c in self.children:
                if c.process.is_alive():
                    logger.warning("%s did not stop in %.0f s: killing it", c.name, grace)
                    c.process.kill()
                    c.process.join(2.0)
                c.conn.close()
            self.ipc.cleanup()
