"""DeepSeek-V2/V3 routed experts: the group-limited gate, the stacked experts of layers/moe.py and
the always-on shared experts.

Gate (replicated on every rank, weights and math in fp32 as Hugging Face keeps them):
- V2 (`softmax`): softmax over the experts; `group_limited_greedy` keeps the `topk_group` groups
  of `n_group` with the highest single expert and zeroes the rest before the top k. The weights
  are the top-k probabilities, times `routed_scaling_factor`, or instead renormalised to sum to
  one when `norm_topk_prob` (DeepSeek's original gate; every public V2 config has it off, which
  is what transformers implements).
- V3 (`sigmoid`, `noaux_tc`): sigmoid scores; the choice adds `e_score_correction_bias` and
  ranks groups by the sum of their two best experts; the weights are the chosen experts'
  unbiased scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.moe import FusedExperts, Routing


@dataclass(frozen=True)
class GateSpec:
    """How the gate scores and picks experts (the model fills it from its config)."""

    scoring_func: Literal["softmax", "sigmoid"]
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"]
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")


class GroupLimitedRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, cfg: GateSpec) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..n_routed_experts ({num_experts})")
        if num_experts % cfg.n_group:
            raise ValueError(f"n_routed_experts ({num_experts}) is not a multiple of n_group ({cfg.n_group})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] True for the experts of each token's `topk_group` best groups."""
        groups = torch.topk(group_scores, k=self.cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        return mask.repeat_interleave(self.num_experts // self.cfg.n_group, dim=1)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = F.linear(hidden.float(), self.weight.float())
        cfg, tokens = self.cfg, hidden.shape[0]
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if cfg.topk_method == "group_limited_greedy":
                group_best = scores.view(tokens, cfg.n_group, -1).amax(dim=-1)
                scores = scores.masked_fill(~self._group_mask(group_best), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            if self.norm_topk_prob and self.top_k > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            else:
                weights = weights * cfg.routed_scaling_factor
        else:
            scores = logits.sigmoid()
            assert self.e_score_correction_bias is not None
            choice = scores + self.e_score_correction_bias
            group_best = choice.view(tokens, cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_best), float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * cfg.routed_scaling_factor
        return Routing(weights.to(hidden.dtype), ids)


class DeepseekMoE(nn.Module):
    """Routed experts plus `n_shared_experts` shared ones (one dense MLP of that many times the
    expert width, applied to every token): [T, H] -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, gate: GateSpec,
                 shared: nn.Module | None) -> None:  # fmt: skip
        super().__init__()
        self.gate = GroupLimitedRouter(num_experts, hidden, top_k, gate)
        self.experts = FusedExperts(num_experts, hidden, intermediate)
        self.shared_experts = shared

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
