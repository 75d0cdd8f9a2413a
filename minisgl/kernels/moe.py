"""Fused mixture-of-experts in two launches (plus a sort): every expert's gate_up GEMM with
SiLU-and-mul, then every expert's down GEMM scaled by the routing weight.

The T * K (token, k) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M, so one program tile of BLOCK_M rows belongs to a single expert and reads that expert's
weights once for all of its rows. The padding slots hold the sentinel pair id T * K and are
masked out. The number of tiles is bounded on the host from shapes alone (T * K + min(E, T * K)
* (BLOCK_M - 1) rows), tiles past the used ones see the sentinel expert E and return at once, so
nothing reads a device value on the host: safe to capture in a CUDA graph.

Rounding follows `moe_ref.py` (HF): gate and up round to the activation dtype, silu(gate) rounds
before the product with up, the down projection rounds before the routing weight scales it, and
the top-k products are summed per token in k order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class ExpertTiles(NamedTuple):
    """(token, k) pairs sorted by expert, each expert's run padded to whole tiles."""

    sorted_pairs: torch.Tensor  # [num_tiles * block_m] int32: pair id t * K + k, or T * K (padding)
    tile_expert: torch.Tensor  # [num_tiles] int32: the tile's expert, E past the used tiles
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """Group the pairs of `topk_ids` [T, K] by expert (stable: pairs keep their order within an
    expert) into tiles of `block_m` rows, without host reads."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=device) - count_start[sorted_experts]
    slots = padded_start[sorted_experts] + rank_in_expert

    num_tiles = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[slots] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=device, dtype=torch.int64) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return ExpertTiles(sorted_pairs, tile_expert, block_m)


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    N: tl.constexpr,  # intermediate size per rank: w holds N gate rows then N up rows
    K: tl.constexpr,  # hidden size
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's gate and up rows, transposed for the dot.
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc_gate = tl.dot(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, (silu * up).to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch
def _down_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    N: tl.constexpr,  # hidden size
    K: tl.constexpr,  # intermediate size per rank
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    pairs = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + pairs[:, None] * stride_xt + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    out = acc.to(dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


class _Tiling(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _tiling(num_pairs: int, num_experts: int, dtype: torch.dtype) -> _Tiling:
    """Tile rows to the expected run per expert (decode: a few rows per expert, so small tiles
    waste little on padding); fp32 halves BLOCK_K to keep the tiles' registers in budget."""
    rows_per_expert = num_pairs / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return _Tiling(block_m, 64, block_k, num_warps=4, num_stages=3 if block_m < 64 else 2)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `moe_ref.moe_ref`: hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I];
    topk_weights [T, K] (cast to hidden's dtype); topk_ids [T, K] -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    assert hidden.shape == (num_tokens, hidden_size) and hidden.stride(-1) == 1
    assert w2.shape == (num_experts, hidden_size, inter)
    num_pairs = num_tokens * top_k
    out_pairs = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out_pairs.view(num_tokens, hidden_size)
    tiling = _tiling(num_pairs, num_experts, hidden.dtype)
    tiles = align_by_expert(topk_ids, num_experts, tiling.block_m)
    num_tiles = tiles.tile_expert.numel()
    # fp32 checks parity with HF: no TF32 rounding of the GEMM inputs.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    launch = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages}

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_silu_kernel[(num_tiles, triton.cdiv(inter, tiling.block_n))](
        hidden, w13, act, tiles.sorted_pairs, tiles.tile_expert, num_pairs,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        N=inter, K=hidden_size, NUM_EXPERTS=num_experts, TOP_K=top_k,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, PRECISION=precision,
        **launch,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).to(hidden.dtype)
    _down_kernel[(num_tiles, triton.cdiv(hidden_size, tiling.block_n))](
        act, w2, out_pairs, weights, tiles.sorted_pairs, tiles.tile_expert, num_pairs,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out_pairs.stride(0),
        N=hidden_size, K=inter, NUM_EXPERTS=num_experts,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, PRECISION=precision,
        **launch,
    )  # fmt: skip
    if top_k == 1:
        return out_pairs
    return out_pairs.view(num_tokens, top_k, hidden_size).sum(dim=1)
