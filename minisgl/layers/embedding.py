from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.layers.linear import select_linear


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across ranks (padded to a multiple of the TP size)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} does not match the config")
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.start : self.start + rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the (sharded) vocabulary; logits gathered to full vocab on every rank."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)
        self._linear = select_linear(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
