"""Joining a tensor-parallel group through the launch's rendezvous store.

The launcher of node 0 hosts one torch.distributed `TCPStore` for the whole launch: on a free
port of its own, or on `--dist-init-addr` when several nodes take part. Each TP group (one per
`--dp` replica) keeps its keys under its own prefix. Every scheduler process connects to the store
as a client, joins its group's process group (gloo on CPU, NCCL on CUDA) through it, and keeps the
prefixed store to exchange the addresses where its ranks receive relayed messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """Where one TP group meets: the launch's store and the group's key prefix."""

    host: str
    port: int
    group: str  # key prefix of this TP group ("replica0", ...)
    timeout_s: float = 600.0  # how long a rank waits for its peers (the start-up timeout)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"bad rendezvous port {self.port}")


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the launch's store; waits up to `timeout_s` for it to be reachable."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def host_store(host: str, port: int) -> dist.TCPStore:
    """The launch's store, served from this process (`port` 0: any free port, see `.port`)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False)


def init_tp_group(rdzv: Rendezvous, rank: int, size: int, backend: str) -> dist.Store:
    """Join the group as `rank` of `size`; returns the group's prefixed store."""
    import torch.distributed as dist

    store = dist.PrefixStore(f"{rdzv.group}/", connect_store(rdzv.host, rdzv.port, rdzv.timeout_s))
    dist.init_process_group(backend=backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=size,
                            timeout=timedelta(seconds=max(rdzv.timeout_s, 1800.0)))  # fmt: skip
    return store
