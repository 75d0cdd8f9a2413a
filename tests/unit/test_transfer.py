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


def test_stacked_views_consecutive_equal_parts_as_one_block() -> None:
    from minisgl.utils.transfer import stacked

    ring = StagingRing(pinned=False)
    parts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13]]
    views = upload_many(ring, torch.device("cpu"), parts)
    block = stacked(views[:4])
    assert block is not None and block.tolist() == parts[:4]
    assert all(block[i].data_ptr() == views[i].data_ptr() for i in range(4))  # the same memory
    views[0][1] = 99  # a write through a part shows in the block
    assert block[0, 1].item() == 99
    assert stacked(views[3:]) is None  # lengths differ
    apart = torch.tensor([4, 5, 6])  # uploaded on its own (LongRoPE's rotary rows)
    assert stacked([views[0], apart, views[2], views[3]]) is None
    longer = upload_many(ring, torch.device("cpu"), [[1, 2], [3, 4, 5, 6, 7], [8, 9]])
    assert stacked([longer[0], longer[1][:2], longer[2]]) is None  # spacing differs


def test_decode_batches_carry_their_inputs_as_one_block() -> None:
    """The engine's decode batches: input_ids, positions, out_loc and rows viewed as one block (what
    a CUDA graph replay copies at once); prefill batches have none."""
    from minisgl import LLM, SamplingParams

    llm = LLM(device="cpu", num_pages=32)
    runner, seen = llm.engine.runner, []
    run = runner.run

    def spy(batch):  # the real runner, recording what it was given (checked now: host staging is reused)
        block, parts = batch.decode_block, [batch.input_ids, batch.positions, batch.out_loc, batch.rows]
        same = block is not None and block.shape == (4, parts[0].numel()) and all(
            torch.equal(block[i], part) for i, part in enumerate(parts))  # fmt: skip
        seen.append((batch.phase, block is not None, same))
        return run(batch)

    runner.run = spy
    llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    decodes = [s for s in seen if s[0] == "decode"]
    assert decodes and all(phase == "decode" or not has_block for phase, has_block, _ in seen)
    assert all(has_block and same for _, has_block, same in decodes), decodes
