from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from minisgl.attention.batch import ForwardBatch


class KVStore(NamedTuple):
    """One layer's K/V caches [slots, Hkv, D] and the slots of the batch's new tokens [T]: where a
    kernel before attention (the fused rotary) may write the new k and v itself; a float8 cache's
    per-layer scales (the writer stores value / scale, saturated: kvcache/pool.py)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out_loc: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class AttnLayerSpec:
    """How one layer attends beyond plain causal softmax: a sliding window (each query sees the
    last `sliding_window` positions, itself included, as Hugging Face masks it) and a tanh
    soft-cap on the scores (`cap * tanh(scores / cap)` before softmax, Gemma 2), and learned
    attention sinks (GPT-OSS): one logit per q head [Hq] that joins each query's softmax
    denominator and contributes no value. `sinks` is the model's parameter itself (read at every
    forward, so it holds the loaded weights). Specs compare and hash by the kernel variant they
    need (the window, the cap, whether there are sinks), not by the sinks' values."""

    sliding_window: int | None = None
    logit_cap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def _variant(self) -> tuple[int | None, float | None, bool]:
        return self.sliding_window, self.logit_cap, self.sinks is not None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttnLayerSpec) and self._variant() == other._variant()

    def __hash__(self) -> int:
        return hash(self._variant())

    def __repr__(self) -> str:
        sinks = None if self.sinks is None else f"[{self.sinks.numel()} heads]"
        return f"AttnLayerSpec(sliding_window={self.sliding_window}, logit_cap={self.logit_cap}, sinks={sinks})"

    def __post_init__(self) -> None:
        assert self.sliding_window is None or self.sliding_window > 0, self.sliding_window
        assert self.logit_cap is None or self.logit_cap > 0, self.logit_cap
        assert self.sinks is None or self.sinks.dim() == 1, "sinks: one logit per q head"

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.logit_cap is None and self.sinks is None


class BaseAttnBackend(ABC):
    """Paged attention over the KV pool. One instance serves every layer."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-batch metadata (stored on `batch.attn_meta`) once before the layers run."""

    def kv_store(self, layer_id: int, batch: ForwardBatch) -> KVStore | None:
        """Where the caller may store this layer's new k/v itself (then it passes none to
        `forward`), or None: `forward` stores them."""
        return None

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """Store the new k/v ([T, Hkv, D]) at `batch.out_loc` (None: already stored through
        `kv_store`), then attend.

        q: [T, Hq, D]. Returns [T, Hq, D]. Causal: new token j of a request with prefix length p
        sees positions <= p + j.
        """

    def configure_layer(self, layer_id: int, spec: AttnLayerSpec) -> None:
        """Set how `layer_id` attends (called once per layer when the model is bound). A backend
        that cannot run a non-plain spec refuses it here, at engine start."""
        if not spec.is_plain:
            raise ValueError(
                f"the {type(self).__name__} attention backend does not implement sliding-window, "
                f"soft-capped or sink attention ({spec}); run this model with --attn torch"
            )

    def warmup(self, token_table: torch.Tensor, row: int) -> None:
        """Compile, at engine start, kernel variants that eager steps could otherwise first need in
        the middle of serving (default: none). `row` is a token-table row whose first slot may be
        read."""

    # CUDA-graph hooks: a backend that supports graph capture overrides these.
    def init_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError
