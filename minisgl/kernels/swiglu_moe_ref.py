"""Plain-torch routed experts with biases and GPT-OSS's clamped SwiGLU: the oracle for
`kernels/swiglu_moe.py` and the CPU path.

Per (token, k) pair through expert e, as transformers' GptOssExperts computes it:
  gate, up = W13[e] x + b13[e]              (gate rows first, then up rows)
  gate = min(gate, limit); up = clamp(up, -limit, limit)
  h = (up + 1) * gate * sigmoid(alpha * gate)
  y = weight * (W2[e] h + b2[e])
and the top-k products summed per token, in k order (as `moe_ref`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[..., 2I] (gate then up) -> [..., I]: GPT-OSS's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; b13 [E, 2I]; w2 [E, H, I]; b2 [E, H] or None (a TP rank
    other than the first: the bias is added once, before the all-reduce); topk_weights [T, K];
    topk_ids [T, K] -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1, 1).to(hidden.dtype)
    pair_out = hidden.new_zeros(num_tokens * top_k, w2.shape[1])
    # Host sync on the expert ids: fine for the oracle and the CPU path, not capturable in a graph.
    for expert in torch.unique(flat_ids).tolist():
        pairs = torch.nonzero(flat_ids == expert).squeeze(1)
        x = hidden.index_select(0, torch.div(pairs, top_k, rounding_mode="floor"))
        act = clamped_swiglu(F.linear(x, w13[expert], b13[expert]), limit, alpha)
        out = F.linear(act, w2[expert], None if b2 is None else b2[expert])
        pair_out.index_copy_(0, pairs, out * flat_weights.index_select(0, pairs))
    return pair_out.view(num_tokens, top_k, -1).sum(dim=1)
