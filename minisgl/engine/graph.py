"""Runners that turn a ForwardBatch into logits: eager everywhere, CUDA graphs for decode.

`GraphRunner` captures the decode forward for a ladder of batch sizes up to `max_bs`; a live
decode batch is padded to the nearest captured size (padding rows attend to nothing and write
their KV to the pool's scratch slot) and replayed. Anything else runs eagerly. The captured
kernels read the runner's static input buffers, the attention metadata included.

A decode step's inputs reach those buffers in one host-to-device copy (`stage_decode`: the
engine hands its host lists, the runner packs them, padding included, as its buffers lie, into a
fixed host buffer), and each graph writes the token-table entries of its entries itself (its
first node: rows, positions -> int32 slots, from the static buffers), so the host work between
a step's tokens and the next replay is the copy, the backend's replay hook and the replay. That
is the critical path of a speculative verify step, which cannot be planned before the step before
it completes (docs/speculative.md). A batch built apart (LongRoPE rows, a partial gather of
in-flight tokens) is copied in as before (`run`: the int64 inputs as one block, the lengths, the
int32 slots, padding entries set to the scratch row and slot).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.batch import ForwardBatch, forward_context
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


class Runner(Protocol):
    def run(self, batch: ForwardBatch) -> torch.Tensor: ...

    def run_pooled(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def stage_decode(
        self, input_ids: Sequence[int], positions: Sequence[int], out_loc: Sequence[int], rows: Sequence[int],
        seq_lens: list[int], prev_tokens: torch.Tensor | None = None, src: Sequence[int] = (),
    ) -> ForwardBatch | None: ...  # fmt: skip


class EagerRunner:
    def __init__(self, model: nn.Module, backend: BaseAttnBackend) -> None:
        self.model = model
        self.backend = backend

    def stage_decode(
        self, input_ids: Sequence[int], positions: Sequence[int], out_loc: Sequence[int], rows: Sequence[int],
        seq_lens: list[int], prev_tokens: torch.Tensor | None = None, src: Sequence[int] = (),
    ) -> ForwardBatch | None:  # fmt: skip
        return None  # nothing to stage into: the engine builds the batch

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.prepare(batch)
        with forward_context(batch):
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.sample_idx])

    def run_pooled(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of `batch.sample_idx`, final hidden states of `batch.pool_idx`): a step of an
        embedding model. Without sampled rows no logits are computed (an embedding model has
        no LM head)."""
        self.backend.prepare(batch)
        with forward_context(batch):
            hidden = self.model(batch.input_ids, batch.positions)
        pooled = hidden[batch.pool_idx] if batch.pool_idx is not None else hidden[:0]
        if batch.sample_idx.numel() == 0:
            return hidden.new_empty((0, 0)), pooled
        return self.model.compute_logits(hidden[batch.sample_idx]), pooled


def graph_batch_sizes(max_bs: int, max_requests: int | None = None, entries_per_request: int = 1) -> list[int]:
    """The decode entry counts captured, up to `max_bs` (`graph_capacity`): 1, 2, 4, 8, then every 16.

    With speculative decoding (`entries_per_request` = 1 + K) a step holds 1 + K entries for each
    request that verifies proposals and 1 for each that has none: the ladder of request counts up
    to `max_requests`, and each of its sizes times 1 + K, capped at `max_bs`. One request with
    K = 4 captures [1, 5], not the ladder [1, 2, 4, 5]: its steps are 1 or 5 entries (fewer
    proposals pad to 5), and on the H200 every graph of a process replays ~8 % slower once it holds
    a fourth one (docs/speculative.md, "CUDA graphs")."""
    def ladder(top: int) -> list[int]:
        sizes = [bs for bs in (1, 2, 4, 8) if bs <= top]
        sizes += list(range(16, top + 1, 16))
        if sizes[-1] != top:
            sizes.append(top)
        return sizes

    if entries_per_request == 1 or max_requests is None:
        return ladder(max_bs)
    requests = ladder(min(max_requests, max_bs))
    verify = [r * entries_per_request for r in requests if r * entries_per_request <= max_bs]
    return sorted(set(requests) | set(verify) | {max_bs})


def graph_capacity(cuda_graph_max_bs: int, max_running_requests: int, entries_per_request: int = 1) -> int:
    """The largest decode entry count captured: every running request's entries (1 + K each with
    speculative decoding: a verify row is K + 1 decode entries), at most `cuda_graph_max_bs`."""
    return min(cuda_graph_max_bs, max_running_requests * entries_per_request)


def replay_size(sizes: list[int], batch: ForwardBatch) -> int | None:
    """The captured size a batch replays (its entry count padded up), None: it runs eagerly
    (not a decode batch, or more entries than the largest graph)."""
    bs = batch.batch_size
    if batch.phase != "decode" or not sizes or bs > sizes[-1]:
        return None
    return next(size for size in sizes if size >= bs)


def padded_rows(n: int) -> int:
    """The row count an eager step pads `n` (tokens, or logits rows) to: a power of two up to 8,
    a multiple of 16 up to 1024 (the graph sizes up to there), then a multiple of n's top power of
    two / 64 (at most 1.6 % more rows). cuBLAS spends ~0.3-4 ms of host time on a GEMM shape it
    has not run before (its heuristics, and loading the kernel it picks), against ~30 us for one it
    has; an eager prefill step, whose row counts would otherwise be new every step, then stalls
    the GPU (tools/probe_gemm_host.py)."""
    if n <= 8:
        return 1 << (n - 1).bit_length() if n else 0
    if n <= 1024:
        return -(-n // 16) * 16
    step = 1 << (n.bit_length() - 7)
    return -(-n // step) * step


class Replayable(Protocol):
    def replay(self) -> None: ...


class CudaGraphs:
    """Captures CUDA graphs that share one memory pool (the first, largest, graph's)."""

    def __init__(self) -> None:
        self.pool: object | None = None

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out


class EagerGraphs:
    """A stand-in for `CudaGraphs` where there are none (CPU tests and host-time probes): a replay
    runs the captured forward again, on the same static buffers and metadata, into the captured
    output, which is what a graph replay computes."""

    def synchronize(self) -> None:
        pass

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        out = forward()
        return _Rerun(forward, out), out


class _Rerun:
    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.forward = forward
        self.out = out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class GraphRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: BaseAttnBackend,
        token_table: torch.Tensor,
        sizes: list[int],
        scratch_row: int,
        scratch_slot: int,
        device: torch.device,
        graphs: CudaGraphs | EagerGraphs | None = None,
        pin_memory: bool = True,
    ) -> None:
        self.eager = EagerRunner(model, backend)
        self.capturer = graphs if graphs is not None else CudaGraphs()
        self.model = model
        self.backend = backend
        self.token_table = token_table
        self.sizes = sizes  # ascending (graph_batch_sizes)
        self.max_bs = max_bs = sizes[-1]
        self.scratch_row = scratch_row
        self.scratch_slot = scratch_slot
        # Row `scratch_row` belongs to no request: the static rows start there, and its first slot
        # is the scratch slot (what the backend's start-up warm-up reads). Padding entries of a
        # replay hold the scratch row (`stage_decode`) or whatever row they last held (a batch
        # copied in by `run`); their seq_len 0 reads none of it.
        token_table[scratch_row, 0] = scratch_slot
        long = dict(dtype=torch.int64, device=device)
        # Every input in one buffer (`stage_decode` fills it with one copy), in rows of `width`
        # int64 (16-byte aligned): input_ids, positions, out_loc, rows (the first four also as one
        # [4, max_bs] block, where a batch uploaded as `ForwardBatch.decode_block` lands), the
        # gather's source indices into the step in flight's tokens, then a row of int32 pairs:
        # seq_lens and out_loc in int32 (the token table's type).
        self.width = width = -(-max_bs // 2) * 2
        self.packed = torch.zeros(6 * width, **long)  # type: ignore[arg-type]
        self.inputs = self.packed[: 4 * width].view(4, width)[:, :max_bs]
        self.input_ids, self.positions, self.out_loc, self.rows = self.inputs.unbind(0)
        self.gather_src = self.packed[4 * width : 5 * width]
        int32 = self.packed[5 * width :].view(torch.int32)
        self.seq_lens = int32[:max_bs]
        self.slots32 = int32[width : width + max_bs]
        self.out_loc.fill_(scratch_slot)
        self.rows.fill_(scratch_row)
        self.slots32.fill_(scratch_slot)
        # Host side of `stage_decode`: two buffers the size of `packed` (pinned on CUDA; two: step
        # N+1 is staged while N's copy may be in flight), each written through a memoryview (no
        # tensor made per step), and the padding it writes past a batch: no token, scratch slot and row.
        self._host = [torch.zeros(6 * width, dtype=torch.int64, pin_memory=pin_memory) for _ in range(2)]
        self._host_views = [memoryview(host.numpy()).cast("B").cast("q") for host in self._host]
        self._turn = 0
        self._zeros = [0] * width
        self._scratch_slots = [scratch_slot] * width
        self._scratch_rows = [scratch_row] * width
        self._staged: ForwardBatch | None = None  # the batch `stage_decode` put in the buffers
        self._views: dict[int, ForwardBatch] = {}  # `_view`
        self.arange = torch.arange(max_bs, **long)  # type: ignore[arg-type]
        self.arange32 = self.arange.int()
        self.ones32 = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.replays = 0  # steps replayed / run eagerly since start (bench spec --verify-cost reads them)
        self.eager_runs = 0
        self.graphs: dict[int, Replayable] = {}
        self.logits: dict[int, torch.Tensor] = {}
        backend.init_graph_state(max_bs)
        self._capture_all()

    def _static_batch(self, bs: int, seq_lens_cpu: list[int] | None = None) -> ForwardBatch:
        """The captured buffers as a batch of `bs`; `seq_lens_cpu`: the host lengths of what they
        hold (the backend orders work by them), 1 per entry when not given."""
        return ForwardBatch(
            phase="decode",
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_loc=self.out_loc[:bs],
            rows=self.rows[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.ones32[:bs],
            extend_starts=self.arange32[:bs],
            token_table=self.token_table,
            seq_lens_cpu=seq_lens_cpu if seq_lens_cpu is not None else [1] * bs,
            extend_lens_cpu=[1] * bs,
            sample_idx=self.arange[:bs],
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        table = self.token_table
        for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its memory pool
            batch = self._static_batch(bs)
            self.backend.prepare_for_capture(batch)
            entries, slots = (self.rows[:bs], self.positions[:bs]), self.slots32[:bs]

            def forward(
                batch: ForwardBatch = batch, entries: tuple[torch.Tensor, ...] = entries, slots: torch.Tensor = slots
            ) -> torch.Tensor:
                # The token-table entries of this step's tokens (padding entries: the scratch row's
                # position 0, its scratch slot), in the graph: one launch less per step.
                table.index_put_(entries, slots)
                with forward_context(batch):
                    hidden = self.model(batch.input_ids, batch.positions)
                return self.model.compute_logits(hidden)

            for _ in range(2):  # warm up (autotuning, lazy init) outside the graph
                forward()
            self.capturer.synchronize()
            self.graphs[bs], self.logits[bs] = self.capturer.capture(forward)
        self.capturer.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def stage_decode(
        self, input_ids: Sequence[int], positions: Sequence[int], out_loc: Sequence[int], rows: Sequence[int],
        seq_lens: list[int], prev_tokens: torch.Tensor | None = None, src: Sequence[int] = (),
    ) -> ForwardBatch | None:  # fmt: skip
        """Put a decode batch (one entry per token; host lists) in the static buffers with one
        copy (the graph writes its token-table entries); the batch returned replays without
        further copies (`run`). `src`: where every input token is one the step in flight samples, its
        index in `prev_tokens` (gathered on the device). None: no captured size holds the batch
        (the engine builds it to run eagerly)."""
        bs = len(rows)
        if not self.sizes or bs > self.max_bs:
            return None
        pad = self.width - bs
        zeros, no_slot = self._zeros, self._scratch_slots[:pad]
        no_token = zeros[:pad]
        # The buffer's rows as one list, then one array each for the int64 rows and the int32 tail.
        flat = array("q", [*input_ids, *no_token, *positions, *no_token, *out_loc, *no_slot, *rows,
                           *self._scratch_rows[:pad], *src, *zeros[len(src) :]])  # fmt: skip
        flat.frombytes(array("i", [*seq_lens, *no_token, *out_loc, *no_slot]).tobytes())
        self._turn = turn = self._turn ^ 1
        self._host_views[turn][:] = flat
        self.packed.copy_(self._host[turn], non_blocking=True)
        if src:
            assert prev_tokens is not None and len(src) == bs
            torch.index_select(prev_tokens, 0, self.gather_src[:bs], out=self.input_ids[:bs])
        batch = self._staged = self._view(bs, seq_lens)
        return batch

    def _view(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """`_static_batch(bs, seq_lens_cpu)`, one object per size kept between steps (its host
        lengths replaced): no views are sliced per replay."""
        batch = self._views.get(bs)
        if batch is None:
            batch = self._views[bs] = self._static_batch(bs, seq_lens_cpu)
        batch.seq_lens_cpu = seq_lens_cpu
        return batch

    def run_pooled(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.eager.run_pooled(batch)  # steps with embedding requests are never decode steps

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        padded = replay_size(self.sizes, batch)
        if padded is None:
            self.eager_runs += 1
            return self.eager.run(batch)
        self.replays += 1
        bs = batch.batch_size
        if batch is self._staged:
            self._staged = None  # its inputs are in the buffers (`stage_decode`), padding included
        else:
            if batch.decode_block is not None:
                self.inputs[:, :bs].copy_(batch.decode_block)
            else:
                self.input_ids[:bs].copy_(batch.input_ids)
                self.positions[:bs].copy_(batch.positions)
                self.out_loc[:bs].copy_(batch.out_loc)
                self.rows[:bs].copy_(batch.rows)
            self.seq_lens[:bs].copy_(batch.seq_lens)
            self.slots32[:bs].copy_(batch.out_loc)  # the graph writes the table entries (again) from them
            if padded > bs:
                # Padding entries attend to nothing (seq_len 0), write their KV to the scratch slot
                # and their table entry to the scratch row's position 0 (a row left from an earlier
                # step may belong to a live request now); their token is left (valid, unused).
                self.out_loc[bs:padded].fill_(self.scratch_slot)
                self.slots32[bs:padded].fill_(self.scratch_slot)
                self.rows[bs:padded].fill_(self.scratch_row)
                self.positions[bs:padded].zero_()
                self.seq_lens[bs:padded].zero_()
        lens = batch.seq_lens_cpu if padded == bs else batch.seq_lens_cpu + [0] * (padded - bs)
        self.backend.prepare_for_replay(self._view(padded, lens))
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
