"""Small host-to-device uploads that never make the host wait for queued GPU work."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor (pinned staging and a non-blocking copy on CUDA)."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)
