"""`triton` attention backend: the paged Triton kernels of `kernels/attention.py` over the KV pool.

Extend batches (prefill, chunked prefill) run the causal extend kernel; decode batches run the
split-K decode kernel, which CUDA graphs can capture: its split count is fixed per captured batch
size and its per-request inputs live in static buffers owned here. In a mixed step (a prefill
chunk with decodes riding along) the one-token rows take the decode kernel too: the extend kernel
would spend a 64-row tile, and a KV read per q head instead of per KV head, on each of them.

Each layer's `AttnLayerSpec` (`configure_layer`) picks its kernels' variant: a sliding window
(keys that slid out are masked, and blocks wholly before the window are never read) and a logit
soft-cap, and attention sinks (GPT-OSS; the tensor travels in the spec). A model whose every layer is windowed sizes eager decode splits by the window, not the
sequence. Pages that slid out of a window stay in the pool, as with the torch backend.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import torch

from minisgl.attention.base import AttnLayerSpec, BaseAttnBackend, KVStore
from minisgl.attention.batch import ForwardBatch
from minisgl.kernels.attention import (
    MAX_DECODE_SPLITS,
    DecodeLaunch,
    alloc_decode_buffers,
    decode_attention,
    decode_graph_launch,
    decode_num_splits,
    extend_attention,
)
from minisgl.kernels.attention.extend import contiguous_bases, extend_reads_runs
from minisgl.kernels.store_kv import store_kv
from minisgl.kvcache.pool import KVPool
from minisgl.platform import current, pins_host_memory
from minisgl.utils.transfer import StagingRing, upload

_PLAIN = AttnLayerSpec()


@dataclass(slots=True)
class TritonDecodeMeta:
    rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    order: torch.Tensor  # [B] int32: the requests longest first, the order their programs start in
    launch: DecodeLaunch  # the split-K kernel's split count (a launch constant), tile and pipeline
    mid_o: torch.Tensor  # [>=B, Hq, >=num_splits, D] fp32 partial outputs
    mid_lse: torch.Tensor  # [>=B, Hq, >=num_splits] fp32 partial log-sum-exps


@dataclass(slots=True)
class MixedSplit:
    """A mixed extend step cut in two: the one-token rows for the decode kernel, the rest for the
    extend kernel (each a subset of the batch's per-request tensors, in batch order)."""

    token_idx: torch.Tensor  # [Bd] int64: the q/out row of each one-token request
    decode: TritonDecodeMeta
    rows: torch.Tensor  # [Be] int64, and the three below: the multi-token requests
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_starts: torch.Tensor


@dataclass(slots=True)
class TritonExtendMeta:
    max_extend_len: int  # longest extend the extend kernel runs (sizes its grid); host-side lengths
    max_seq_len: int  # longest prefix + extend among them (picks the kernel's launch)
    split: MixedSplit | None = None  # set when some requests extend by one token
    # Each extend request's first slot where its slots are one run, else -1 (`contiguous_bases`),
    # once for every layer; None where the launch reads every key through the table.
    kv_bases: torch.Tensor | None = None


TritonAttnMeta = TritonExtendMeta | TritonDecodeMeta


@dataclass(slots=True)
class _GraphBuffers:
    """Decode state the captured kernels read by address, besides the runner's static batch."""

    max_bs: int
    order: torch.Tensor  # [max_bs] int32; the batch longest first, then the padding entries
    # Flat fp32 scratch shared by every captured size: size bs views it as [bs, Hq, splits(bs), D].
    # splits(bs) falls as bs grows, so the largest bs * splits(bs) bounds it (a few MB).
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    # Host staging for `order` (int32): a replay's copy may be in flight while the next is staged.
    order_host: StagingRing
    token_table_ptr: int | None = None  # the table captured graphs read; it must stay the same tensor
    staged_order: list[int] | None = None  # what `order` holds (`prepare_for_replay`), None: unknown


class TritonAttnBackend(BaseAttnBackend):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        assert pool.num_kv_heads == num_kv_heads and pool.head_dim == head_dim, "pool layout differs from the model's"
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale
        self.device = pool.k[0].device
        # Captured sizes take their measured launch where there is one (--decode-tuned).
        self.decode_tuned = current().kernels.decode_tuned
        self._graph: _GraphBuffers | None = None
        self.specs: dict[int, AttnLayerSpec] = {}  # non-plain layers only
        self.decode_window: int | None = None  # the widest window, when every layer has one

    def configure_layer(self, layer_id: int, spec: AttnLayerSpec) -> None:
        if spec.is_plain:
            self.specs.pop(layer_id, None)
        else:
            self.specs[layer_id] = spec
        # Decode reads at most the widest window when every layer has one (else the sequence).
        windows = [self.specs[i].sliding_window if i in self.specs else None for i in range(len(self.pool.k))]
        self.decode_window = None if None in windows else max(w for w in windows if w is not None)

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.phase == "decode":
            batch.attn_meta = self._decode_meta(batch.rows, batch.seq_lens, batch.seq_lens_cpu)
        else:
            batch.attn_meta = self._extend_meta(batch)

    def _decode_meta(self, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int]) -> TritonDecodeMeta:
        """Eager decode of these requests (host lengths `lens`): splits for this batch, fresh
        scratch buffers."""
        batch_size = rows.shape[0]
        span = max(lens) if self.decode_window is None else min(max(lens), self.decode_window)
        num_splits = decode_num_splits(batch_size, self.num_kv_heads, self.head_dim, span, self.device)
        mid_o, mid_lse = alloc_decode_buffers(batch_size, self.num_heads, self.head_dim, num_splits, self.device)
        order = upload(_longest_first(lens), torch.int32, self.device)
        return TritonDecodeMeta(rows, seq_lens, order, DecodeLaunch(num_splits), mid_o, mid_lse)

    def _extend_meta(self, batch: ForwardBatch) -> TritonExtendMeta:
        meta = self._extend_split(batch)
        group = self.num_heads // self.num_kv_heads
        if meta.max_extend_len and extend_reads_runs(self.pool.compute_dtype, self.head_dim, group, meta.max_seq_len):
            split = meta.split
            rows, seq_lens = (batch.rows, batch.seq_lens) if split is None else (split.rows, split.seq_lens)
            meta.kv_bases = contiguous_bases(batch.token_table, rows, seq_lens)
        return meta

    def _extend_split(self, batch: ForwardBatch) -> TritonExtendMeta:
        lens = batch.extend_lens_cpu
        one = [i for i, n in enumerate(lens) if n == 1]
        if not one:
            return TritonExtendMeta(max(lens, default=0), max(batch.seq_lens_cpu, default=0))
        many = [i for i, n in enumerate(lens) if n != 1]
        index = upload(one + many, torch.int64, self.device)  # one non-blocking copy
        one_t, many_t = index[: len(one)], index[len(one) :]
        decode = self._decode_meta(
            batch.rows.index_select(0, one_t), batch.seq_lens.index_select(0, one_t),
            [batch.seq_lens_cpu[i] for i in one],
        )  # fmt: skip
        split = MixedSplit(
            token_idx=batch.extend_starts.index_select(0, one_t).long(),
            decode=decode,
            rows=batch.rows.index_select(0, many_t),
            seq_lens=batch.seq_lens.index_select(0, many_t),
            extend_lens=batch.extend_lens.index_select(0, many_t),
            extend_starts=batch.extend_starts.index_select(0, many_t),
        )
        max_seq_len = max((batch.seq_lens_cpu[i] for i in many), default=0)
        return TritonExtendMeta(max((lens[i] for i in many), default=0), max_seq_len, split)

    def kv_store(self, layer_id: int, batch: ForwardBatch) -> KVStore | None:
        # The fused rotary kernel writes k and v into the pool, saving the store launch per layer
        # (a float8 pool's: divided by the layer's scales and saturated, as `store_kv` does).
        pool = self.pool
        return KVStore(pool.k[layer_id], pool.v[layer_id], batch.out_loc, pool.k_scale[layer_id], pool.v_scale[layer_id])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        if k is not None and v is not None:
            kv_shape = (-1, self.num_kv_heads, self.head_dim)
            store_kv(k.view(kv_shape), v.view(kv_shape), k_cache, v_cache, batch.out_loc,
                     self.pool.k_scale[layer_id], self.pool.v_scale[layer_id])  # fmt: skip
        q = q.view(-1, self.num_heads, self.head_dim)
        meta = batch.attn_meta
        spec = self.specs.get(layer_id, _PLAIN)
        # Each layer's variant: its window and soft-cap, and a float8 pool's scales (1.0 otherwise).
        window, softcap, sinks = spec.sliding_window, spec.logit_cap, spec.sinks
        scales = {"k_scale": self.pool.k_scale[layer_id], "v_scale": self.pool.v_scale[layer_id]}
        if isinstance(meta, TritonDecodeMeta):
            return decode_attention(
                q, k_cache, v_cache, batch.token_table, meta.rows, meta.seq_lens, self.sm_scale,
                mid_o=meta.mid_o, mid_lse=meta.mid_lse, order=meta.order, **meta.launch._asdict(),
                window=window, softcap=softcap, sinks=sinks, **scales,
            )  # fmt: skip
        assert isinstance(meta, TritonExtendMeta), "prepare() did not run for this batch"
        split = meta.split
        if split is None:
            return extend_attention(
                q, k_cache, v_cache, batch.token_table, batch.rows, batch.seq_lens, batch.extend_lens,
                batch.extend_starts, self.sm_scale, max_extend_len=meta.max_extend_len,
                max_seq_len=meta.max_seq_len, window=window, softcap=softcap, sinks=sinks, kv_bases=meta.kv_bases,
                **scales,
            )  # fmt: skip
        out = torch.empty_like(q)
        # The extend kernel writes only its requests' rows of `out`; the decode rows go in after.
        extend_attention(
            q, k_cache, v_cache, batch.token_table, split.rows, split.seq_lens, split.extend_lens,
            split.extend_starts, self.sm_scale, max_extend_len=meta.max_extend_len,
            max_seq_len=meta.max_seq_len, out=out, window=window, softcap=softcap, sinks=sinks,
            kv_bases=meta.kv_bases, **scales,
        )  # fmt: skip
        d = split.decode
        decoded = decode_attention(
            q.index_select(0, split.token_idx), k_cache, v_cache, batch.token_table, d.rows, d.seq_lens,
            self.sm_scale, mid_o=d.mid_o, mid_lse=d.mid_lse, order=d.order, **d.launch._asdict(),
            window=window, softcap=softcap, sinks=sinks, **scales,
        )  # fmt: skip
        return out.index_copy_(0, split.token_idx, decoded)

    def warmup(self, token_table: torch.Tensor, row: int) -> None:
        """Compile the decode kernels for every split count eager decode can pick (a power of two up
        to MAX_DECODE_SPLITS, a compile-time constant), and the extend kernel's launches for short
        and long sequences: one request of one token at `row`, once per kind of layer the model
        has (plain, windowed, soft-capped, with sinks: each its own kernel variant)."""
        q = torch.zeros(1, self.num_heads, self.head_dim, dtype=self.pool.compute_dtype, device=self.device)
        rows = torch.full((1,), row, dtype=torch.int64, device=self.device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=self.device)
        order = torch.zeros(1, dtype=torch.int32, device=self.device)
        starts = torch.zeros(1, dtype=torch.int32, device=self.device)
        # Each distinct spec once (a window's value can pick another specialization too).
        for spec in {self.specs.get(i, _PLAIN) for i in range(len(self.pool.k))}:
            window, softcap, sinks = spec.sliding_window, spec.logit_cap, spec.sinks
            splits = 1
            while splits <= MAX_DECODE_SPLITS:
                decode_attention(
                    q, self.pool.k[0], self.pool.v[0], token_table, rows, seq_lens, self.sm_scale,
                    num_splits=splits, order=order, window=window, softcap=softcap, sinks=sinks,
                )  # fmt: skip
                splits *= 2
            for max_seq_len in (1, None):
                extend_attention(
                    q, self.pool.k[0], self.pool.v[0], token_table, rows, seq_lens, seq_lens, starts, self.sm_scale,
                    max_extend_len=1, max_seq_len=max_seq_len, window=window, softcap=softcap, sinks=sinks,
                )  # fmt: skip

    # --- CUDA graphs (decode only) ---

    def init_graph_state(self, max_bs: int) -> None:
        capacity = max(bs * self._graph_launch(bs).num_splits for bs in range(1, max_bs + 1))
        self._graph = _GraphBuffers(
            max_bs=max_bs,
            order=torch.arange(max_bs, dtype=torch.int32, device=self.device),
            mid_o=torch.empty(capacity * self.num_heads * self.head_dim, dtype=torch.float32, device=self.device),
            mid_lse=torch.empty(capacity * self.num_heads, dtype=torch.float32, device=self.device),
            order_host=StagingRing(pinned=pins_host_memory(self.device), dtype=torch.int32),
        )

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """Metadata for capturing decode at `batch.batch_size`: the kernels will read the batch's
        own `rows` and `seq_lens` (the runner's static buffers, refreshed before each replay) and
        this backend's static order and scratch.

        The split count assumes a long context (lengths change between replays); requests shorter
        than that leave the surplus splits empty. Sizes measured on this GPU and shape take their
        tuned launch (`GRAPH_TUNED`)."""
        graph = self._graph_for(batch)
        batch_size = batch.batch_size
        if graph.token_table_ptr is None:
            graph.token_table_ptr = batch.token_table.data_ptr()
        self.prepare_for_replay(batch)
        launch = self._graph_launch(batch_size)
        shape = (batch_size, self.num_heads, launch.num_splits)
        batch.attn_meta = TritonDecodeMeta(
            rows=batch.rows,
            seq_lens=batch.seq_lens,
            order=graph.order[:batch_size],
            launch=launch,
            mid_o=graph.mid_o[: math.prod(shape) * self.head_dim].view(*shape, self.head_dim),
            mid_lse=graph.mid_lse[: math.prod(shape)].view(shape),
        )

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Before a replay: the order of the requests in the captured batch's buffers, which the
        caller has refreshed, padded to the captured size (padding entries have seq_len 0: the
        kernels compute nothing there and output zeros). One host-to-device copy, none when the
        order is the one the buffer holds (the usual decode step: every length grew by one; a
        speculative verify row's entries are always in the same order)."""
        graph = self._graph_for(batch)
        batch_size = batch.batch_size
        # Padding entries (any captured size may read them) follow in their own order.
        order = _longest_first(batch.seq_lens_cpu) + list(range(batch_size, graph.max_bs))
        if order != graph.staged_order:
            graph.order.copy_(graph.order_host.stage(array("i", order)), non_blocking=True)
            graph.staged_order = order

    def _graph_launch(self, batch_size: int) -> DecodeLaunch:
        return decode_graph_launch(
            batch_size, self.num_heads, self.num_kv_heads, self.head_dim, self.pool.dtype, self.device,
            tuned=self.decode_tuned,
        )

    def _graph_for(self, batch: ForwardBatch) -> _GraphBuffers:
        graph = self._graph
        assert graph is not None, "init_graph_state() must run before capture or replay"
        assert batch.phase == "decode" and batch.batch_size <= graph.max_bs
        assert graph.token_table_ptr in (None, batch.token_table.data_ptr()), "captured graphs read another table"
        return graph


def _longest_first(lens: list[int]) -> list[int]:
    """Indices of `lens` from the longest to the shortest (stable)."""
    return sorted(range(len(lens)), key=lens.__getitem__, reverse=True)


def create_triton_backend(
    pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float
) -> TritonAttnBackend:
    """Registry entry point (`ATTN_BACKENDS["triton"]`); head counts are per TP rank."""
    return TritonAttnBackend(pool, num_heads, num_kv_heads, head_dim, sm_scale)
