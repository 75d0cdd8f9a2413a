"""The LoRA delta of one linear layer: out += B[slot] @ A[slot] @ x, per segment of the batch.

Each layer holds `max_loras` slots of A [parts * max_rank, in] and B [out, parts * max_rank]
(zero-padded where an adapter's rank is lower, zero for parts the adapter does not train). A
fused layer (qkv, gate_up) stacks its parts' A rows, and its B is block-structured: part p's
output rows read only columns [p * max_rank, (p + 1) * max_rank), so one shrink and one expand
cover every part. Tensor parallelism follows the base layer: a column-parallel layer keeps A
whole and this rank's rows of B; a row-parallel one this rank's columns of A and B whole (its
partial delta joins the partial sum before the all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear

Part = str | int | None


@dataclass
class LoraSegments:
    """This step's runs of tokens by adapter slot (base-model tokens in none), host and device."""

    starts: list[int]
    lens: list[int]
    slots: list[int]
    starts_t: torch.Tensor
    lens_t: torch.Tensor
    slots_t: torch.Tensor

    @property
    def max_len(self) -> int:
        return max(self.lens)


class LoraStepState:
    """What every layer's delta reads: the current step's segments (None: no adapter in it)."""

    def __init__(self) -> None:
        self.segments: LoraSegments | None = None


class LoraLinear:
    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear, state: LoraStepState, max_loras: int,
                 max_rank: int, use_triton: bool) -> None:  # fmt: skip
        self.layer = layer
        self.state = state
        self.max_rank = max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.parts: tuple[Part, ...] = (None,) if isinstance(layer, RowParallelLinear) else layer.parts
        weight = layer.weight
        self.out_local, self.in_local = weight.shape
        width = len(self.parts) * max_rank
        self.a = torch.zeros(max_loras, width, self.in_local, dtype=weight.dtype, device=weight.device)
        self.b = torch.zeros(max_loras, self.out_local, width, dtype=weight.dtype, device=weight.device)
        self.use_triton = use_triton

    # ------------------------------------------------------------------ weights
    def host_weights(self, module: str, tensors: dict[Part, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's A and B for this layer, laid out as a slot (this rank's shard), on the
        host. `tensors`: part -> (A [r, in_full], B [out_full, r]); parts missing stay zero."""
        layer, rank_cap = self.layer, self.max_rank
        a = torch.zeros(self.a.shape[1:], dtype=self.a.dtype)
        b = torch.zeros(self.b.shape[1:], dtype=self.b.dtype)
        for part, (a_full, b_full) in tensors.items():
            if part not in self.parts:
                raise ValueError(f"{module}: no part {part!r} in this layer")
            rank = a_full.shape[0]
            col = self.parts.index(part) * rank_cap
            if self.row_parallel:
                assert isinstance(layer, RowParallelLinear)
                _check(module, "lora_A", a_full.shape[1], self.in_local * layer.tp_size)
                _check(module, "lora_B", b_full.shape[0], self.out_local)
                a[col : col + rank] = a_full.narrow(1, layer.tp_rank * self.in_local, self.in_local)
                b[:, col : col + rank] = b_full
            else:
                assert isinstance(layer, ColumnParallelLinear)
                offset, size, shard = layer.part_rows(part)
                _check(module, "lora_A", a_full.shape[1], self.in_local)
                if b_full.shape[0] < (shard + 1) * size:
                    raise ValueError(f"{module}: lora_B has {b_full.shape[0]} rows, the model needs {(shard + 1) * size}")
                a[col : col + rank] = a_full
                b[offset : offset + size, col : col + rank] = b_full.narrow(0, shard * size, size)
        return a, b

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy an adapter's host weights into `slot` (None: zero it, the adapter skips this layer)."""
        if weights is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(weights[0], non_blocking=True)
        self.b[slot].copy_(weights[1], non_blocking=True)

    # ------------------------------------------------------------------ forward
    def add_(self, x: torch.Tensor, out: torch.Tensor) -> None:
        seg = self.state.segments
        if seg is None:
            return
        x = x if x.is_contiguous() else x.contiguous()
        shrunk = x.new_empty(x.shape[0], self.a.shape[1])
        if self.use_triton:
            from minisgl.kernels.lora import segment_matmul

            max_len = seg.max_len
            segment_matmul(x, self.a, shrunk, seg.starts_t, seg.lens_t, seg.slots_t, max_len, accumulate=False)
            segment_matmul(shrunk, self.b, out, seg.starts_t, seg.lens_t, seg.slots_t, max_len, accumulate=True)
        else:
            from minisgl.kernels.lora_ref import segment_matmul_ref

            segment_matmul_ref(x, self.a, shrunk, seg.starts, seg.lens, seg.slots, accumulate=False)
            segment_matmul_ref(shrunk, self.b, out, seg.starts, seg.lens, seg.slots, accumulate=True)


def _check(module: str, which: str, got: int, want: int) -> None:
    if got != want:
        raise ValueError(f"{module}: {which} has {got} features where the model has {want}")
