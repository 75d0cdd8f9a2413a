from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.attention.batch import ForwardBatch


class BaseAttnBackend(ABC):
    """Paged attention over the KV pool. One instance serves every layer."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-batch metadata (stored on `batch.attn_meta`) once before the layers run."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """Store the new k/v ([T, Hkv, D]) at `batch.out_loc`, then attend.

        q: [T, Hq, D]. Returns [T, Hq, D]. Causal: new token j of a request with prefix length p
        sees positions <= p + j.
        """

    # CUDA-graph hooks: a backend that supports graph capture overrides these.
    def init_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError
