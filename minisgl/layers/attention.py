from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import AttnLayerSpec, BaseAttnBackend, KVStore
from minisgl.attention.batch import current_batch


class AttentionLayer(nn.Module):
    """Runs the engine's attention backend for one layer on the current forward batch. `spec`
    carries the layer's sliding window / soft-cap (default: plain causal attention)."""

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, spec: AttnLayerSpec | None = None
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.spec = spec if spec is not None else AttnLayerSpec()
        self.backend: BaseAttnBackend | None = None  # bound by the engine once the KV pool exists

    def bind(self, backend: BaseAttnBackend) -> None:
        """Attach the engine's backend and tell it this layer's spec (it refuses one it cannot run)."""
        backend.configure_layer(self.layer_id, self.spec)
        self.backend = backend

    def kv_store(self) -> KVStore | None:
        """Where this layer's new k/v may be written before `forward` (which then gets none), or
        None when the backend stores them itself."""
        assert self.backend is not None, "attention backend not bound"
        return self.backend.kv_store(self.layer_id, current_batch())

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        assert self.backend is not None, "attention backend not bound"
        out = self.backend.forward(q, k, v, self.layer_id, current_batch())
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
