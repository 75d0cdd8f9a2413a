"""Parallel layout without processes: the `--dp` router's rule, which TP sizes a model allows,
the parallel flags, which scheduler ranks each node runs, and stats summed over replicas."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from minisgl.distributed.group import Rendezvous
from minisgl.distributed.layout import ShardedDims, check_tp_size, valid_tp_sizes
from minisgl.message.frontend import StatsMsg
from minisgl.server import args
from minisgl.server.frontend import ServiceStats
from minisgl.server.metrics import ServerMetrics
from minisgl.server.processes import ServiceProcesses
from minisgl.tokenizer.router import ReplicaRouter

# ------------------------------------------------------------------ router


def test_router_picks_fewest_outstanding_tokens_and_frees_on_finish():
    router = ReplicaRouter(3)
    assert router.assign(0, 100) == 0  # all idle: the lowest index
    assert router.assign(1, 10) == 1
    assert router.assign(2, 10) == 2
    assert router.assign(3, 10) == 1  # 1 and 2 tie at 10: the lower
    assert router.outstanding == [100, 20, 10]
    assert router.assign(4, 95) == 2
    assert router.outstanding == [100, 20, 105]
    router.finished([0, 99])  # an unknown rid is ignored
    assert router.outstanding == [0, 20, 105] and router.owner(0) is None
    assert router.assign(5, 1) == 0
    assert [router.owner(rid) for rid in (1, 3, 4, 5)] == [1, 1, 2, 0]
    assert router.assigned == [2, 2, 2] and router.live == 5


def test_single_replica_router_remembers_nothing():
    router = ReplicaRouter(1)
    assert [router.assign(rid, 50) for rid in range(3)] == [0, 0, 0]
    assert router.owner(7) == 0 and router.live == 0


# ------------------------------------------------------------------ TP sizes

SMOLLM2 = ShardedDims(num_heads=9, num_kv_heads=3, intermediate_size=1536)


def test_tp_sizes_of_a_model():
    assert valid_tp_sizes(SMOLLM2) == [1, 3]
    # 2 KV heads: split over 2 ranks, replicated over 4 or 8.
    assert valid_tp_sizes(ShardedDims(8, 2, 1024), limit=16) == [1, 2, 4, 8]
    # Expert layers only: the dense intermediate size does not matter.
    assert valid_tp_sizes(ShardedDims(4, 4, 0, moe_intermediate_size=96), limit=8) == [1, 2, 4]


def test_tp_size_that_does_not_divide_names_the_fix():
    check_tp_size(SMOLLM2, 3)
    with pytest.raises(ValueError, match=r"^--tp 4 cannot split this model \(4 does not divide its 9 attention "
                       r"heads and its 3 key/value heads .*\); use --tp 1 or 3$"):  # fmt: skip
        check_tp_size(SMOLLM2, 4)
    with pytest.raises(ValueError, match=r"MLP intermediate size 1536\); use --tp 1 or 3$"):
        check_tp_size(ShardedDims(18, 9, 1536), 9)


# ------------------------------------------------------------------ flags


def test_parallel_flags():
    config = args.parse_args(["--tp", "4", "--dp", "2", "--nnodes", "2", "--node-rank", "1",
                              "--dist-init-addr", "10.0.0.1:29500"])  # fmt: skip
    assert config.engine.tp_size == 4
    p = config.parallel
    assert (p.dp_size, p.nnodes, p.node_rank, p.dist_init_addr, p.is_head) == (2, 2, 1, ("10.0.0.1", 29500), False)
    assert args.parse_args(["--dist-init-addr", "[::1]:7"]).parallel.dist_init_addr == ("::1", 7)
    assert args.parse_args([]).parallel == args.ParallelConfig()


@pytest.mark.parametrize("argv, needle", [
    (["--nnodes", "2", "--tp", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"], "--tp 3 is not a multiple of --nnodes 2"),
    (["--nnodes", "2", "--tp", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank must be in [0, 1]"),
    (["--dist-init-addr", "h"], "expected HOST:PORT"),
    (["--dist-init-addr", "h:0"], "expected HOST:PORT"),
    (["--dp", "0"], "--dp: expected a positive integer"),
    (["--shell", "--nnodes", "2", "--tp", "2", "--node-rank", "1", "--dist-init-addr", "h:1"], "node 0 only"),
])  # fmt: skip
def test_bad_parallel_flags_fail_in_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit):
        args.parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


# ------------------------------------------------------------------ which ranks run where


@dataclass
class _FakeCluster:
    def rendezvous(self, replica: int) -> Rendezvous:
        return Rendezvous("127.0.0.1", 1234, f"replica{replica}")

    def rank_address(self) -> str:
        return "tcp://10.0.0.2:*"


def _schedulers(argv: list[str]) -> dict[str, dict]:
    config = args.parse_args(argv)
    procs = ServiceProcesses(config, "unused", 128, _FakeCluster())  # type: ignore[arg-type]
    try:
        return {name: kwargs for name, _, kwargs in procs._specs if name not in ("tokenizer", "detokenizer")}
    finally:
        procs.ipc.cleanup()


def test_each_node_runs_its_share_of_every_replica():
    tp4 = ["--tp", "4", "--dp", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:29500"]
    head = _schedulers([*tp4, "--node-rank", "0"])
    other = _schedulers([*tp4, "--node-rank", "1"])
    assert list(head) == ["dp0-scheduler-0", "dp0-scheduler-1", "dp1-scheduler-0", "dp1-scheduler-1"]
    assert list(other) == ["dp0-scheduler-2", "dp0-scheduler-3", "dp1-scheduler-2", "dp1-scheduler-3"]
    assert [k["device_index"] for k in other.values()] == [0, 1, 2, 3]  # GPUs of this node
    assert {k["rdzv"].group for k in head.values()} == {"replica0", "replica1"}
    # Rank 0 receives from the tokenizer on ipc; ranks on node 0 on ipc; ranks elsewhere on TCP.
    assert all(k["addrs"].recv.startswith("ipc://") for k in head.values())
    assert all(k["addrs"].recv == "tcp://10.0.0.2:*" for k in other.values())
    # Replicas tell the tokenizer which requests ended only when there is a choice.
    assert all(k["addrs"].router is not None for k in head.values())
    single = _schedulers(["--tp", "2"])
    assert list(single) == ["scheduler-0", "scheduler-1"] and single["scheduler-0"]["addrs"].router is None


# ------------------------------------------------------------------ stats of every replica


def _stats(requests: int, running: int, free: int) -> StatsMsg:
    return StatsMsg(query_id=0, total_pages=100, free_pages=free, cached_pages=0, evictable_pages=0, running=running,
                    waiting=0, prompt_tokens=10, cached_tokens=5, requests=requests, aborted=1)  # fmt: skip


def test_stats_summed_and_per_replica_in_metrics():
    stats = ServiceStats([_stats(3, 1, 90), _stats(5, 2, 50)])
    total = stats.total
    assert (total.requests, total.running, total.total_pages, total.free_pages, total.aborted) == (8, 3, 200, 140, 2)
    text = ServerMetrics("m").render(stats).decode()
    assert re.search(r'^minisgl_replica_requests_total\{model_name="m",replica="0"\} 3\.0$', text, re.M)
    assert re.search(r'^minisgl_replica_requests_total\{model_name="m",replica="1"\} 5\.0$', text, re.M)
    assert re.search(r'^minisgl_replica_kv_cache_usage_ratio\{model_name="m",replica="1"\} 0\.5$', text, re.M)
    assert re.search(r'^minisgl_kv_cache_usage_ratio\{model_name="m"\} 0\.3$', text, re.M)
    assert re.search(r'^minisgl_num_requests_running\{model_name="m"\} 3\.0$', text, re.M)
