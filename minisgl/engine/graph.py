"""Runners that turn a ForwardBatch into logits: eager everywhere, CUDA graphs for decode.

`GraphRunner` captures the decode forward for a ladder of batch sizes up to `max_bs`; a live
decode batch is padded to the nearest captured size (padding rows attend to nothing and write
their KV to the pool's scratch slot) and replayed. Anything else runs eagerly.

Large decode batches can be captured as two half-batches on two streams, interleaved layer by
layer (`forward_halves`). Attention reads the KV cache at the memory's bandwidth, while the
projections of these skinny batches leave most of it idle; so one half's projections and small
kernels run while the other half's attention does. `HalfBatchFence` makes the two halves'
attention kernels take turns.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch
from torch import nn

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.batch import ForwardBatch, forward_context
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


class Runner(Protocol):
    def run(self, batch: ForwardBatch) -> torch.Tensor: ...


class EagerRunner:
    def __init__(self, model: nn.Module, backend: BaseAttnBackend) -> None:
        self.model = model
        self.backend = backend

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.prepare(batch)
        with forward_context(batch):
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.sample_idx])


class HalfBatchFence:
    """Orders the attention kernels of two half-batches running on two streams: the first half's
    layer 0, the second half's layer 0, the first's layer 1, ... Everything else of one half (its
    projections, norms, rotary) is free to run beside the other half's attention.
    `alternate=False` leaves the streams unordered (for measurement)."""

    def __init__(self, alternate: bool = True) -> None:
        self.alternate = alternate
        self.done: tuple[dict[int, torch.cuda.Event], dict[int, torch.cuda.Event]] = ({}, {})

    def half(self, index: int) -> "_HalfFence":
        return _HalfFence(self, index)


class _HalfFence:
    """One half's side of a `HalfBatchFence` (an `attention.batch.AttentionFence`)."""

    def __init__(self, fence: HalfBatchFence, index: int) -> None:
        self.fence = fence
        self.index = index

    def before(self, layer_id: int) -> None:
        if not self.fence.alternate:
            return
        # The second half follows the first's same layer; the first, the second's layer before.
        other, layer = (1, layer_id - 1) if self.index == 0 else (0, layer_id)
        if layer >= 0:
            torch.cuda.current_stream().wait_event(self.fence.done[other][layer])

    def after(self, layer_id: int) -> None:
        self.fence.done[self.index].setdefault(layer_id, torch.cuda.Event()).record()


def forward_halves(
    model: nn.Module, halves: tuple[ForwardBatch, ForwardBatch], side: torch.cuda.Stream | None
) -> torch.Tensor:
    """Hidden states of two half-batches, concatenated, issued one decoder layer of each in turn:
    the first half on the current stream, the second on `side` (None: the current stream too)."""
    main = torch.cuda.current_stream() if side is not None else None
    if side is not None:
        side.wait_stream(main)
    steps = [model.forward_steps(batch.input_ids, batch.positions) for batch in halves]
    hidden: list[torch.Tensor | None] = [None, None]
    while hidden[0] is None or hidden[1] is None:
        for i, batch in enumerate(halves):
            if hidden[i] is not None:
                continue
            stream = torch.cuda.stream(side) if i == 1 and side is not None else contextlib.nullcontext()
            with stream, forward_context(batch):
                try:
                    next(steps[i])
                except StopIteration as stop:
                    hidden[i] = stop.value
    first, second = hidden
    assert first is not None and second is not None
    if side is not None:
        main.wait_stream(side)
        second.record_stream(main)
    return torch.cat((first, second))


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class GraphRunner:
    """`two_batch_min_bs`: captured sizes from this one up (even ones) run as two half-batches
    (0: never)."""

    def __init__(
        self,
        model: nn.Module,
        backend: BaseAttnBackend,
        token_table: torch.Tensor,
        max_bs: int,
        scratch_row: int,
        scratch_slot: int,
        device: torch.device,
        two_batch_min_bs: int = 0,
        alternate: bool = True,
    ) -> None:
        self.eager = EagerRunner(model, backend)
        self.model = model
        self.backend = backend
        self.token_table = token_table
        self.max_bs = max_bs
        self.sizes = graph_batch_sizes(max_bs)
        self.scratch_row = scratch_row
        self.scratch_slot = scratch_slot
        # Padding entries: row `scratch_row` maps position 0 to the scratch slot.
        token_table[scratch_row, 0] = scratch_slot
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **long)  # type: ignore[arg-type]
        self.positions = torch.zeros(max_bs, **long)  # type: ignore[arg-type]
        self.out_loc = torch.full((max_bs,), scratch_slot, **long)  # type: ignore[arg-type]
        self.rows = torch.full((max_bs,), scratch_row, **long)  # type: ignore[arg-type]
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.arange = torch.arange(max_bs, **long)  # type: ignore[arg-type]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # Captured size -> the size of its first half when captured as two half-batches, else 0.
        self.half = {bs: bs // 2 if 0 < two_batch_min_bs <= bs and bs % 2 == 0 else 0 for bs in self.sizes}
        self.alternate = alternate
        self.side = torch.cuda.Stream(device) if any(self.half.values()) else None
        backend.init_graph_state(max_bs)
        self._capture_all()

    def _static_batch(self, bs: int, seq_lens_cpu: list[int] | None = None, start: int = 0) -> ForwardBatch:
        """Entries [start, start + bs) of the captured buffers as a batch; `seq_lens_cpu`: the host
        lengths of what they hold (the backend orders work by them), 1 per entry when not given."""
        entries = slice(start, start + bs)
        return ForwardBatch(
            phase="decode",
            input_ids=self.input_ids[entries],
            positions=self.positions[entries],
            out_loc=self.out_loc[entries],
            rows=self.rows[entries],
            seq_lens=self.seq_lens[entries],
            extend_lens=torch.ones_like(self.seq_lens[entries]),
            extend_starts=self.arange[:bs].int(),
            token_table=self.token_table,
            seq_lens_cpu=seq_lens_cpu if seq_lens_cpu is not None else [1] * bs,
            extend_lens_cpu=[1] * bs,
            sample_idx=self.arange[:bs],
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its memory pool
            forward = self._prepare_capture(bs)
            for _ in range(2):  # warm up (autotuning, lazy init, the side stream's cuBLAS) outside the graph
                self.model.compute_logits(forward())
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self.model.compute_logits(forward())
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        split = [bs for bs in self.sizes if self.half[bs]]
        logger.info(
            "captured CUDA graphs for decode batch sizes %s%s", self.sizes,
            f", two half-batches from {split[0]} up" if split else "",
        )  # fmt: skip

    def _prepare_capture(self, bs: int) -> Callable[[], torch.Tensor]:
        """Point the backend at the static buffers for size `bs`; the forward to capture."""
        half = self.half[bs]
        if not half:
            batch = self._static_batch(bs)
            self.backend.prepare_for_capture(batch)

            def forward() -> torch.Tensor:
                with forward_context(batch):
                    return self.model(batch.input_ids, batch.positions)

            return forward
        halves = (self._static_batch(half), self._static_batch(bs - half, start=half))
        for part, batch in enumerate(halves):
            self.backend.prepare_for_capture(batch, offset=part * half, part=part)

        def forward_split() -> torch.Tensor:
            fence = HalfBatchFence(self.alternate)
            for index, batch in enumerate(halves):
                batch.fence = fence.half(index)
            return forward_halves(self.model, halves, self.side)

        return forward_split

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        if batch.phase != "decode" or bs > self.max_bs:
            return self.eager.run(batch)
        padded = next(size for size in self.sizes if size >= bs)
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_loc[:bs].copy_(batch.out_loc)
        self.rows[:bs].copy_(batch.rows)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_loc[bs:padded].fill_(self.scratch_slot)
            self.rows[bs:padded].fill_(self.scratch_row)
            self.seq_lens[bs:padded].fill_(1)
        half = self.half[padded]
        self.backend.prepare_for_replay(
            self._static_batch(padded, batch.seq_lens_cpu + [1] * (padded - bs)), (half,) if half else ()
        )
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
