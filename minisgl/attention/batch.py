"""What one forward pass computes, as device tensors, and the scoped context that carries it.

Layers read the current batch from the forward context (attention needs its metadata); models
still take `input_ids` and `positions` as explicit arguments.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import torch

Phase = Literal["extend", "decode"]


@dataclass
class ForwardBatch:
    """A ragged batch: T new tokens from B requests, request i owning tokens
    [extend_starts[i], extend_starts[i] + extend_lens[i]).

    KV layout: slot `s` of layer `l` is `pool.k[l][s]`; `token_table[row, pos]` is the slot of
    position `pos` of the request in `row`. Before attention runs, the table already holds the
    slots of every position < seq_len (the engine writes the new ones from `out_loc`).
    """

    phase: Phase  # "decode" iff every request extends by exactly one token
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, the rotary table rows: positions (LongRoPE: `layers.rotary.long_rope_rows`)
    out_loc: torch.Tensor  # [T] int64, the KV slot written for each new token
    rows: torch.Tensor  # [B] int64, token-table row of each request
    seq_lens: torch.Tensor  # [B] int32, KV length after this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int32, new tokens per request
    extend_starts: torch.Tensor  # [B] int32, offset of request i's first new token in T
    token_table: torch.Tensor  # [R, C] int32
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    sample_idx: torch.Tensor  # [S] int64, token indices (into T) whose logits are needed
    # [P] int64, token indices whose final hidden states are returned (embedding requests), or None.
    pool_idx: torch.Tensor | None = None
    # [4, T] int64: input_ids, positions, out_loc and rows as one strided view of the same memory,
    # where the engine uploaded them so (a decode step): a graph replay copies its inputs in one go.
    decode_block: torch.Tensor | None = None
    attn_meta: Any = field(default=None)  # filled by the attention backend's prepare()

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu) if self.seq_lens_cpu else 0

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]


_CURRENT: ForwardBatch | None = None


@contextlib.contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Make `batch` the current batch for the duration of one forward; refuses nesting."""
    global _CURRENT
    assert _CURRENT is None, "forward_context does not nest"
    _CURRENT = batch
    try:
        yield batch
    finally:
        _CURRENT = None


def current_batch() -> ForwardBatch:
    assert _CURRENT is not None, "attention ran outside forward_context"
    return _CURRENT
