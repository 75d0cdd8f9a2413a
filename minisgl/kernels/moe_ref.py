"""Plain-torch mixture-of-experts: the oracle for `kernels/moe.py` and the CPU path.

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
