"""utils/transfer.upload_many: one transfer, the right values and dtypes, every view 16-byte aligned
(Triton compiles a kernel variant per pointer alignment, so unaligned views would make it compile
again mid-run)."""

from __future__ import annotations

import random

import torch

from minisgl.utils.transfer import StagingRing, upload_many


def test_upload_many_values_dtypes_and_alignment() -> None:
    rng = random.Random(0)
    ring = StagingRing(pinned=False)
    for _ in range(20):
        sizes = [rng.randrange(0, 9) for _ in range(rng.randrange(1, 8))]
        parts = [[rng.randrange(-(2**40), 2**40) for _ in range(n)] for n in sizes]
        tail = rng.randrange(0, len(parts) + 1)
        for j in range(len(parts) - tail, len(parts)):  # int32 parts hold int32 values
            parts[j] = [v % 2**31 for v in parts[j]]
        views = upload_many(ring, torch.device("cpu"), parts, int32_tail=tail)
        assert [v.tolist() for v in views] == parts
        dtypes = [torch.int64] * (len(parts) - tail) + [torch.int32] * tail
        assert [v.dtype for v in views] == dtypes
        assert all(v.data_ptr() % 16 == 0 for v in views)


def test_staging_ring_keeps_its_dtype() -> None:
    ring = StagingRing(pinned=False, dtype=torch.int32)
    first, second = ring.take(3), ring.take(5000)
    assert first.dtype == second.dtype == torch.int32 and second.numel() == 5000
    assert first.data_ptr() == ring.take(2).data_ptr()  # taken in turn: the third reuses the first buffer
