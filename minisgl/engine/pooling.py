"""Embedding requests in the engine: their rows of a step, and the vectors made from them.

An embedding request is a prefill that samples nothing: the step computing its last prompt token
returns that token's final hidden state (after the model's last norm) instead of logits. The
host copy is cut to the request's `dimensions` and L2-normalized here, one row at a time (a few
thousand floats each), and handed to the scheduler as float32 little-endian bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import Req


def embedding_bytes(hidden: torch.Tensor, dimensions: int | None, normalize: bool) -> bytes:
    """One embedding from a final hidden state [H] (float32 on the host): the first `dimensions`
    values (Matryoshka), then L2-normalized when `normalize`."""
    vec = hidden[:dimensions] if dimensions is not None else hidden
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.contiguous().numpy().astype("<f4", copy=False).tobytes()


@dataclass
class PooledRows:
    """The embedding requests whose last prompt token a step computes, and their final hidden
    states (a host copy in flight, valid once the step's event completes)."""

    reqs: list[Req]
    hidden: torch.Tensor  # [len(reqs), H] float32 on the host
    normalize: bool
    event: Any = None

    def embeddings(self) -> list[bytes]:
        if self.event is not None:
            self.event.synchronize()
        return [embedding_bytes(row, req.pooling.dimensions if req.pooling else None, self.normalize)
                for req, row in zip(self.reqs, self.hidden)]  # fmt: skip
