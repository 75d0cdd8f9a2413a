"""Host-to-device uploads that never make the host wait for queued GPU work: a single list
(`upload`, pinned staging per call) and the step's many int lists in one copy (`upload_many`,
through reused pinned buffers; `stacked` views consecutive equal-length parts as one block). In `utils` because the engine and the attention backends both
upload per-step metadata."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import pairwise

import torch

from minisgl.platform import pins_host_memory


def upload(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor (pinned staging and a non-blocking copy on CUDA)."""
    pinned = pins_host_memory(device)
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


class StagingRing:
    """Two growable host buffers of `dtype` used alternately (pinned on CUDA): step N+1 is staged
    while step N's copy may still be in flight, and step N is complete before N+2 is staged."""

    def __init__(self, pinned: bool, dtype: torch.dtype = torch.int64) -> None:
        self.pinned = pinned
        self.dtype = dtype
        self.buffers = [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)]
        self.turn = 0

    def take(self, n: int) -> torch.Tensor:
        self.turn ^= 1
        if self.buffers[self.turn].numel() < n:
            size = max(n, 2 * self.buffers[self.turn].numel(), 4096)
            self.buffers[self.turn] = torch.empty(size, dtype=self.dtype, pin_memory=self.pinned)
        return self.buffers[self.turn][:n]

    def stage(self, values: array) -> torch.Tensor:
        """The next buffer, holding `values` (an array of this ring's element type)."""
        host = self.take(len(values))
        if len(values):
            host.copy_(torch.frombuffer(values, dtype=self.dtype))
        return host


_ALIGN = 4  # elements: every part starts 16-byte aligned in int32 as in int64


def upload_many(
    staging: StagingRing, device: torch.device, parts: list[list[int]], int32_tail: int = 0
) -> list[torch.Tensor]:
    """Several host int lists -> device views, one per list, in one non-blocking transfer: int64,
    except the last `int32_tail` lists, which come back int32 from one conversion on the device.

    Each view starts 16-byte aligned. Triton specialises a kernel on whether each pointer argument
    is (`tt.divisibility`), so views at varying offsets would make it compile a second variant of
    a kernel the first time one lands unaligned, in the middle of serving."""
    flat = array("q")
    padded = []
    for part in parts:
        flat.extend(part)
        pad = -len(part) % _ALIGN
        flat.extend([0] * pad)
        padded.append(len(part) + pad)
    dev = staging.stage(flat).to(device, non_blocking=True)
    chunks = list(dev.split(padded))
    if int32_tail:
        head = sum(padded[:-int32_tail])
        chunks[-int32_tail:] = dev[head:].to(torch.int32).split(padded[-int32_tail:])
    return [chunk[: len(part)] for chunk, part in zip(chunks, parts)]


def stacked(views: list[torch.Tensor]) -> torch.Tensor | None:
    """Equal-length 1-D views that `upload_many` returned for consecutive parts, as one [k, n] view
    of the same memory (a single copy moves them all); None when their lengths, dtypes or spacing
    differ (parts of different padded lengths)."""
    first = views[0]
    n, dtype = first.numel(), first.dtype
    if any(v.dim() != 1 or v.numel() != n or v.dtype != dtype or v.stride(0) != 1 for v in views):
        return None
    size = first.element_size()
    gaps = {b.data_ptr() - a.data_ptr() for a, b in pairwise(views)}
    if len(gaps) != 1:
        return None
    gap = gaps.pop()
    if gap < n * size or gap % size or any(v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for v in views):
        return None
    return first.as_strided((len(views), n), (gap // size, 1))
