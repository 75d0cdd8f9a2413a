"""The MoE routing and grouping in one launch each (issue 28): the router's top-k with its softmax,
and the grouping of the (token, k) pairs into expert tiles that the fused expert GEMMs read.

In torch they were ~30 small ops a layer (softmax, topk, renormalise, a histogram, two scans, a
sort, gathers, a fill and a scatter, a binary search); on the GPU's eager steps (prefill, mixed)
their launches filled the launch queue (docs/performance.md, "Profiles of the large shapes").

`topk_route`: one program per block of tokens holds each token's E logits in registers and picks
the top k by k passes of argmax. The ids are the top-k logits, ties going to the lower expert id
(the softmax is monotonic, so this is the top k of the probabilities without the exp's rounding
in the choice). Weights as the routers compute them in torch (`moe_ref.route_ref`): in fp32,
either softmax over all experts then the chosen k (renormalised to sum to one if asked), or
softmax over the chosen k logits only (GPT-OSS), rounded once to the output dtype.

`align_tiles`: one program per expert, plus one for the tail. Every program counts all pairs per
expert (a histogram per chunk), takes its own run's padded start from the counts, writes its
tiles' expert id and its padding's sentinel, and then places its pairs in pair order (a scan of
"is mine" per chunk), so the result equals `moe_ref.align_by_expert_ref` exactly. The writes of
the programs are disjoint; nothing is read back on the host, so CUDA graphs can capture it.
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


def num_tiles_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles enough for any routing, from shapes alone: every pair, plus at most block_m - 1
    padding rows for each expert that has a pair."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


@triton.jit(do_not_specialize=["num_tokens"])  # varies with the batch
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_lt,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFTMAX_FIRST: tl.constexpr,  # softmax over all experts, then the top k (else over the top k only)
    RENORMALIZE: tl.constexpr,  # with SOFTMAX_FIRST: the top k's weights scaled to sum to one
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    experts = tl.arange(0, BLOCK_E)
    mask = row_mask[:, None] & (experts < NUM_EXPERTS)[None, :]
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + experts[None, :], mask=mask,
                     other=float("-inf")).to(tl.float32)  # fmt: skip
    slots = tl.arange(0, BLOCK_K)
    top = tl.full((BLOCK_T, BLOCK_K), float("-inf"), tl.float32)
    top_ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    remaining = logits
    free = mask  # not chosen yet (and a real expert: -inf logits are never picked twice)
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, 1)
        # The lowest id among the maxima: the tie rule.
        best_id = tl.min(tl.where(free & (remaining == best[:, None]), experts[None, :], BLOCK_E), 1)
        top = tl.where(slots[None, :] == k, best[:, None], top)
        top_ids = tl.where(slots[None, :] == k, best_id[:, None], top_ids)
        chosen = experts[None, :] == best_id[:, None]
        remaining = tl.where(chosen, float("-inf"), remaining)
        free = free & ~chosen

    # Rows past the batch hold only -inf: shift them by 0 so no NaN is computed (none is stored).
    row_max = tl.where(row_mask, tl.max(top, 1), 0.0)
    if SOFTMAX_FIRST:
        denom = tl.sum(tl.exp(logits - row_max[:, None]), 1)
        weights = tl.exp(top - row_max[:, None]) / tl.where(row_mask, denom, 1.0)[:, None]
        if RENORMALIZE:
            weights = weights / tl.where(row_mask, tl.sum(weights, 1), 1.0)[:, None]
    else:
        exps = tl.exp(top - row_max[:, None])
        weights = exps / tl.where(row_mask, tl.sum(exps, 1), 1.0)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=out_mask)


def topk_route(
    logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [T, E] -> (weights [T, K] in logits' dtype, ids [T, K] int64, best first); the
    numerics of `moe_ref.route_ref` (ids: ties to the lower expert id)."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    num_tokens, num_experts = logits.shape
    assert 0 < top_k <= num_experts and (softmax_first or not renormalize)
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    # ~2k logits a program (at 128 experts, 16 tokens: 80 registers a thread compiled for sm_90,
    # 32 tokens take 146), fixed rather than fitted to the batch: one compiled variant serves all.
    block_t = max(1, 2048 // block_e)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, logits.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize,
        num_warps=4,
    )  # fmt: skip
    return weights, ids


@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])  # vary with the batch
def _align_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_pairs,
    num_tiles,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
):
    expert = tl.program_id(0)  # NUM_EXPERTS: the tail past the used tiles
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pair_mask = start + offs < num_pairs
        ids = tl.load(ids_ptr + start + offs, mask=pair_mask, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=pair_mask)
    experts = tl.arange(0, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tile_offs = tl.arange(0, TILE_CHUNK)
    rows = tl.arange(0, BLOCK_M)
    if expert == NUM_EXPERTS:
        for tile in range(tl.sum(padded, 0) // BLOCK_M, num_tiles, TILE_CHUNK):
            tiles = tile + tile_offs
            tile_mask = tiles < num_tiles
            tl.store(tile_expert_ptr + tiles, tl.full((TILE_CHUNK,), NUM_EXPERTS, tl.int32), mask=tile_mask)
            slots = tiles[:, None] * BLOCK_M + rows[None, :]
            tl.store(sorted_pairs_ptr + slots, tl.full((TILE_CHUNK, BLOCK_M), num_pairs, tl.int32),
                     mask=tile_mask[:, None])  # fmt: skip
        return
    run_start = tl.sum(tl.where(experts < expert, padded, 0), 0)
    count = tl.sum(tl.where(experts == expert, counts, 0), 0)
    run_end = run_start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    for tile in range(run_start // BLOCK_M, run_end // BLOCK_M, TILE_CHUNK):
        tiles = tile + tile_offs
        tl.store(tile_expert_ptr + tiles, tl.full((TILE_CHUNK,), 0, tl.int32) + expert, mask=tiles < run_end // BLOCK_M)
    padding = run_start + count + rows
    tl.store(sorted_pairs_ptr + padding, tl.full((BLOCK_M,), num_pairs, tl.int32), mask=padding < run_end)
    placed = run_start
    for start in range(0, tl.where(count > 0, num_pairs, 0), CHUNK):
        pair_mask = start + offs < num_pairs
        ids = tl.load(ids_ptr + start + offs, mask=pair_mask, other=NUM_EXPERTS).to(tl.int32)
        mine = (ids == expert).to(tl.int32)
        slots = placed + tl.cumsum(mine, 0) - 1
        tl.store(sorted_pairs_ptr + slots, start + offs, mask=mine != 0)
        placed += tl.sum(mine, 0)


def align_tiles(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """Group the pairs of `topk_ids` [T, K] by expert (stable: pairs keep their order within an
    expert) into tiles of `block_m` rows, in one launch and without host reads."""
    assert topk_ids.is_contiguous() and block_m & (block_m - 1) == 0
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_tiles = num_tiles_bound(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_tiles * block_m, dtype=torch.int32, device=device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return ExpertTiles(sorted_pairs, tile_expert, block_m)
    # One chunk size for every batch (one compiled variant; a decode step's pairs fit in one chunk).
    _align_kernel[(num_experts + 1,)](
        topk_ids, sorted_pairs, tile_expert, num_pairs, num_tiles,
        NUM_EXPERTS=num_experts, BLOCK_E=max(16, triton.next_power_of_2(num_experts)), BLOCK_M=block_m,
        CHUNK=1024, TILE_CHUNK=16, num_warps=4,
    )  # fmt: skip
    return ExpertTiles(sorted_pairs, tile_expert, block_m)
