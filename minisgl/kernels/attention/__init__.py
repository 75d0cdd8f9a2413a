"""Triton paged attention, one module per kernel: `extend` (new tokens over a cached prefix),
`decode` (split-K, one token per request), `tuned` (the decode launch per captured batch size),
over `common` (the shared online-softmax block step). The plain-torch oracle is
`kernels/attention_ref.py`."""

from __future__ import annotations

from minisgl.kernels.attention.common import is_interpreted
from minisgl.kernels.attention.decode import (
    MAX_DECODE_SPLITS,
    DecodeLaunch,
    alloc_decode_buffers,
    decode_attention,
    decode_num_splits,
)
from minisgl.kernels.attention.extend import extend_attention
from minisgl.kernels.attention.tuned import GRAPH_TUNED, decode_graph_launch

__all__ = [
    "GRAPH_TUNED",
    "MAX_DECODE_SPLITS",
    "alloc_decode_buffers",
    "DecodeLaunch",
    "decode_attention",
    "decode_graph_launch",
    "decode_num_splits",
    "extend_attention",
    "is_interpreted",
]
