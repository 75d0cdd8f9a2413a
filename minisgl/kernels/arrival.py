"""Arrival counters for kernels whose last program finishes the job ("last one merges").

A kernel that splits one output over several programs (the split-K GEMM's partial tiles) can
merge the parts without a second launch: each program writes its part, then
atomically bumps the output's counter (acq_rel at GPU scope: its part is released, and the last
arrival acquires everyone's); the program that sees `parts - 1` merges, in a fixed order (so the
result does not depend on who came last), and sets the counter back to 0.

Every such kernel leaves the counters it used at zero, so one zeroed buffer per device serves
them all, one launch after another on the engine's stream (with PDL a kernel touches memory only
after `gdc_wait`, i.e. after its predecessor completed). Launches on two streams at once would
share it; the engine does not do that.
"""

from __future__ import annotations

import functools

import torch

NUM_COUNTERS = 1 << 16  # outputs one launch may merge this way


@functools.cache
def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 counters (see the module docstring)."""
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)


__all__ = ["NUM_COUNTERS", "arrival_counters"]
