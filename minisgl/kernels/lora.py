"""Segmented LoRA matmul in Triton: one launch computes every segment's x @ W[slot].T.

Segments as in `lora_ref.py` (the reference and the test oracle). The grid is (segment, row
block, column block); a program whose row block lies past its segment's end returns at once, so
the grid's row extent is the longest segment's. Accumulation in float32, one rounding to the
output dtype (the reference's order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    starts_ptr,
    lens_ptr,
    slots_ptr,
    N,
    K,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_ot,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    block_m = tl.program_id(1)
    block_n = tl.program_id(2)
    length = tl.load(lens_ptr + seg)
    if block_m * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + seg).to(tl.int64)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < length
    col_ok = cols < N
    tokens = start + rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + slot * stride_ws + cols[None, :] * stride_wn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        acc = tl.dot(x, w.to(x.dtype), acc)  # bf16 / fp16 tensor cores, float32 accumulation
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def segment_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    accumulate: bool,
) -> torch.Tensor:
    """As `segment_matmul_ref`, with the segments as int32 device tensors and `max_len` the
    longest segment (a host int: it sizes the grid). Returns `out`."""
    num_segments = starts.shape[0]
    if num_segments == 0 or max_len == 0:
        return out
    assert x.stride(1) == 1 and weights.stride(2) == 1 and out.stride(1) == 1
    N, K = weights.shape[1], weights.shape[2]
    block_m = 16 if max_len <= 16 else 32
    block_n = 32 if N <= 32 else 64
    block_k = 32
    grid = (num_segments, triton.cdiv(max_len, block_m), triton.cdiv(N, block_n))
    _segment_matmul_kernel[grid](
        x, weights, out, starts, lens, slots, N, K,
        x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
