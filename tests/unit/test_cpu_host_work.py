"""Host work around the CPU kernels of a decode step (issue 23's W1): torch's own threads kept out
of the sampler, and the other per-step savings of the CPU path."""

from __future__ import annotations

import sys

import pytest
import torch

from minisgl.platform.cpu import CpuPlatform, _openmp_runtime


def test_openmp_runtime_is_found_where_torch_threads_with_openmp():
    if sys.platform == "linux" and "ATen parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert _openmp_runtime() is not None


def test_serial_torch_ops_runs_torch_on_one_thread_and_restores_the_count(monkeypatch):
    if _openmp_runtime() is None:
        pytest.skip("no OpenMP runtime of torch's found here: the region changes nothing")
    platform = CpuPlatform()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    # Not through torch.set_num_threads, which would also turn MKL's dynamic threading off.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail("serial_torch_ops called torch.set_num_threads"))
    try:
        with platform.serial_torch_ops():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), platform.serial_torch_ops():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2  # restored on the way out of an error too
    finally:
        monkeypatch.undo()
        torch.set_num_threads(before)


def test_serial_torch_ops_leaves_one_thread_as_it_is():
    platform = CpuPlatform()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with platform.serial_torch_ops():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_scheduler_process_freezes_its_start_up_objects_before_ready(monkeypatch):
    import gc

    from minisgl.engine.config import EngineConfig
    from minisgl.scheduler import process
    from minisgl.scheduler.config import SchedulerConfig

    class FakeScheduler:
        context_len = 64

        def stats(self):
            return type("Stats", (), {"total_pages": 4})()

    class FakeLoop:
        def __init__(self, scheduler, addrs, rank):
            pass

        def announce_limits(self):
            pass

        def run(self):
            pass

        def close(self):
            pass

    seen: dict[str, int] = {}

    class Ready:
        def ready(self, **facts):
            seen["frozen"] = gc.get_freeze_count()

    monkeypatch.setattr(process, "build_scheduler", lambda engine, sched: (None, FakeScheduler()))
    monkeypatch.setattr(process, "SchedulerLoop", FakeLoop)
    # Start-up's malloc pin would last for the rest of this pytest process (the dynamic mmap
    # threshold cannot be turned back on), and test_server_memory's trim test needs it dynamic.
    monkeypatch.setattr(CpuPlatform, "prepare_scheduler_process", lambda self: None)
    gc.unfreeze()
    try:
        process.run_scheduler(EngineConfig(device="cpu"), SchedulerConfig(), None, Ready())  # type: ignore[arg-type]
        assert seen["frozen"] > 0  # the objects alive at start-up are out of the collector's reach
    finally:
        gc.unfreeze()
