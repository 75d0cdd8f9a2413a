"""Plain-torch mixture-of-experts: the oracle for `kernels/moe.py` and `kernels/moe_routing.py`, and
the CPU path.

Rounding follows Hugging Face's Qwen3-MoE experts (`grouped_mm`, its default): each (token, k)
pair goes through its expert in the activation dtype, is scaled by its routing weight, and the
top-k products are summed per token in k order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts, one expert at a time.

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K]
    (hidden's dtype); topk_ids [T, K] (any integer dtype) -> [T, H] =
    sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x) * w13[e, I:] @ x), e = topk_ids[t, k].
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1, 1).to(hidden.dtype)
    pair_out = hidden.new_zeros(num_tokens * top_k, w2.shape[1])
    # Host sync on the expert ids: fine for the oracle and the CPU path, not capturable in a graph.
    for expert in torch.unique(flat_ids).tolist():
        pairs = torch.nonzero(flat_ids == expert).squeeze(1)
        x = hidden.index_select(0, torch.div(pairs, top_k, rounding_mode="floor"))
        gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, w2[expert])
        pair_out.index_copy_(0, pairs, out * flat_weights.index_select(0, pairs))
    return pair_out.view(num_tokens, top_k, -1).sum(dim=1)


def route_ref(
    logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Router logits [T, E] -> (weights [T, K] in logits' dtype, ids [T, K] int64, best first),
    Hugging Face's numerics. `softmax_first` (Qwen3-MoE, Mixtral): softmax over all experts in
    fp32, the top k of it, renormalised to sum to one when `renormalize`. Else (GPT-OSS): the top k
    logits, softmaxed among themselves (fp32 inside, rounded to the logits' dtype)."""
    if softmax_first:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    assert not renormalize, "the top-k softmax sums to one already"
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


def topk_ids_ref(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids of `moe_routing.topk_route`, exactly and on any device: the top k logits, best
    first, equal logits to the lower expert id (a stable descending sort). `route_ref`'s
    torch.topk leaves the order of ties unspecified (on CUDA it differs from this), and with
    `softmax_first` it ranks the rounded probabilities, which can tie where the logits do not."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]


def route_scores_ref(logits: torch.Tensor, softmax_first: bool) -> torch.Tensor:
    """What `route_ref` ranks: the fp32 softmax over all experts, or the logits themselves."""
    return torch.softmax(logits, dim=-1, dtype=torch.float32) if softmax_first else logits


def tied_rows_ref(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] bool: the rows whose top-k ids `scores` (`route_scores_ref`) do not settle, two of
    their top k + 1 within rounding (2^-21 relative: a few fp32 ulps, what exp's rounding on a
    device can reorder). There any valid top k may be returned, in either order of the tie."""
    top = torch.topk(scores.float(), min(top_k + 1, scores.shape[-1]), dim=-1).values
    return ((top[:, :-1] - top[:, 1:]) <= top[:, :-1].abs() * 2.0**-21).any(dim=-1)


def align_by_expert_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, num_tiles: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The oracle of `moe_routing.align_tiles`: (sorted_pairs [num_tiles * block_m] int32,
    tile_expert [num_tiles] int32). The pairs t * K + k of `topk_ids` [T, K] sorted by expert,
    stably (pair order within an expert), each expert's run padded with the sentinel T * K to a
    multiple of `block_m`; a tile's expert is E past the used tiles. In torch ops only (a sort, two
    scans, a scatter), without host reads."""
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
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[slots] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=device, dtype=torch.int64) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return sorted_pairs, tile_expert
