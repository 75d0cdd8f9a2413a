"""The launch's rendezvous store: where TP ranks meet, and how the nodes of one launch follow
each other.

Node 0's launcher hosts a torch.distributed `TCPStore` (on `--dist-init-addr`, or on a free port
of 127.0.0.1 with one node, so TP services side by side never collide); it outlives every rank of
the launch. Scheduler ranks join their TP group through it and publish their relay addresses in it
(`distributed/group.py`, `scheduler/process.py`). The launchers of the other nodes connect to it
as clients to:
- check that they were started with the same layout and settings as node 0 (a mismatch would
  make the ranks of one group schedule differently, so it is refused at start);
- follow node 0: it sets `launch/stop` when it shuts down (the other nodes stop their ranks and
  exit 0 after acknowledging), and a store that stops answering means node 0 died (exit 1);
- report a dead local rank (`launch/failed`), which takes node 0, and so the service, down.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any, Literal

from minisgl.distributed.group import Rendezvous, connect_store, host_store
from minisgl.server.args import ParallelConfig, ServerConfig
from minisgl.utils.logging import get_logger

if TYPE_CHECKING:
    import torch.distributed as dist

logger = get_logger(__name__)

_LAYOUT = "launch/layout"
_STOP = "launch/stop"
_FAILED = "launch/failed"

HeadState = Literal["running", "stopped", "gone"]


def _stopped_key(node: int) -> str:
    return f"launch/node/{node}/stopped"


def _flatten(prefix: str, config: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every leaf field of a (nested) config dataclass as `prefix.field[.subfield]`: value."""
    out: dict[str, Any] = {}
    for f in fields(config):
        if f.name in skip:
            continue
        value = getattr(config, f.name)
        if is_dataclass(value):
            out.update(_flatten(f"{prefix}.{f.name}", value))
        else:
            out[f"{prefix}.{f.name}"] = list(value) if isinstance(value, tuple) else value
    return out


def launch_settings(config: ServerConfig, model: list[Any]) -> dict[str, Any]:
    """What every node of one launch must agree on: every engine and scheduler field (the
    switches included; not the model path, which may differ per machine, nor the rank), the
    layout, and the model's facts (`model`)."""
    return {**_flatten("engine", config.engine, skip=("model", "tp_rank")), **_flatten("scheduler", config.sched),
            "dp": config.parallel.dp_size, "nnodes": config.parallel.nnodes, "model": model}  # fmt: skip


def address_towards(host: str, port: int) -> str:
    """This machine's IP address on the route to `host` (where node 0 reaches this node's ranks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, only the route is chosen
        return str(probe.getsockname()[0])


class Cluster:
    """One launcher's handle on the store: host on node 0, client elsewhere."""

    def __init__(self, parallel: ParallelConfig, settings: dict[str, Any], timeout: float) -> None:
        self.parallel = parallel
        self.timeout = timeout
        self._lock = threading.Lock()  # the watchdog thread and the main thread share the client
        host, port = parallel.dist_init_addr or ("127.0.0.1", 0)
        self.host = host
        layout = json.dumps(settings, sort_keys=True)
        if parallel.is_head:
            try:
                self.store: dist.Store = host_store(host, port)
            except Exception as exc:  # torch raises its own error types (DistNetworkError, ...)
                raise ValueError(f"cannot host the rendezvous store on {host}:{port} ({_short(exc)}); "
                                 "choose another --dist-init-addr port") from None  # fmt: skip
            self.port = int(self.store.port)  # type: ignore[attr-defined]
            self.store.set(_LAYOUT, layout)
            return
        self.port = port
        deadline = time.monotonic() + timeout
        # Wait with plain connections: torch logs a C++ stack trace for each failed store connect.
        logger.info("waiting for node 0 at %s:%d (up to %.0f s)", host, port, timeout)
        while not _reachable(host, port):
            if time.monotonic() > deadline:
                raise ValueError(f"could not reach node 0 at --dist-init-addr {host}:{port} within "
                                 f"{timeout:.0f} s; start node 0 with the same --dist-init-addr "
                                 "(or raise --startup-timeout)")  # fmt: skip
            time.sleep(0.2)
        try:
            self.store = connect_store(host, port, max(1.0, deadline - time.monotonic()))
            theirs = json.loads(self.store.get(_LAYOUT).decode())
        except Exception as exc:
            raise ValueError(f"could not reach node 0 at --dist-init-addr {host}:{port} within {timeout:.0f} s "
                             f"({_short(exc)}); start node 0 with the same --dist-init-addr") from None  # fmt: skip
        differ = sorted(k for k in set(theirs) | set(settings) if theirs.get(k) != settings.get(k))
        if differ:
            detail = ", ".join(f"{k}: node 0 has {theirs.get(k)!r}, this node {settings.get(k)!r}" for k in differ)
            raise ValueError(f"this node's settings differ from node 0's ({detail}); start every node with "
                             "the same options but --node-rank")  # fmt: skip
        if self.store.add(f"launch/node/{parallel.node_rank}/joined", 1) > 1:
            raise ValueError(f"another launch already joined as --node-rank {parallel.node_rank}")

    def rendezvous(self, replica: int) -> Rendezvous:
        return Rendezvous(self.host, self.port, f"replica{replica}", self.timeout)

    def rank_address(self) -> str:
        """Where a rank on this (non-head) node receives relayed bytes: any free port."""
        return f"tcp://{address_towards(self.host, self.port)}:*"

    # ------------------------------------------------------------------ node 0
    def failure(self) -> str | None:
        """What another node reported dead, if anything (polled by node 0's watchdog)."""
        with self._lock:
            try:
                if self.store.check([_FAILED]):
                    return self.store.get(_FAILED).decode()
            except Exception:  # the store is ours: only fails while we shut down
                return None
        return None

    def stop(self, wait: float = 3.0) -> None:
        """Node 0 shuts down: tell the other nodes and give them `wait` s to acknowledge, so they
        stop cleanly instead of finding the store gone."""
        others = [_stopped_key(n) for n in range(1, self.parallel.nnodes)]
        with self._lock:
            try:
                self.store.set(_STOP, "1")
                deadline = time.monotonic() + wait
                while others and not self.store.check(others) and time.monotonic() < deadline:
                    time.sleep(0.05)
            except Exception as exc:
                logger.warning("could not tell the other nodes to stop: %s", _short(exc))

    # ------------------------------------------------------------------ other nodes
    def head_state(self) -> HeadState:
        # A plain connection first: a store request to a dead store would work too, but torch
        # logs a C++ stack trace for it.
        if not _reachable(self.host, self.port):
            return "gone"
        with self._lock:
            try:
                if not self.store.check([_STOP]):
                    return "running"
                self.store.set(_stopped_key(self.parallel.node_rank), "1")
                return "stopped"
            except Exception:
                return "gone"

    def report_failure(self, what: str) -> None:
        with self._lock:
            try:
                self.store.set(_FAILED, f"{what} on node {self.parallel.node_rank}")
            except Exception:
                pass


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError:
        return False
    return True


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
