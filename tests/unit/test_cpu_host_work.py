"""Host work around the CPU kernels of a decode step (issue 23's W1): torch's own threads kept out
of the sampler, and the other per-step savings of the CPU path."""

from __future__ import annotations

import pytest
import torch

from minisgl.platform.cpu import CpuPlatform


def test_serial_torch_ops_runs_torch_on_one_thread_and_restores_the_count():
    platform = CpuPlatform()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with platform.serial_torch_ops():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), platform.serial_torch_ops():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2  # restored on the way out of an error too
    finally:
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
