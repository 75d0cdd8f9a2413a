"""Plain-torch reference of the segmented LoRA matmul (`kernels/lora.py`), and its CPU path.

A batch's tokens are grouped in segments, each a run of consecutive tokens of requests that use
the same adapter slot: segment i covers tokens [starts[i], starts[i] + lens[i]) and multiplies
them by `weights[slots[i]]`. Tokens outside every segment (base-model requests, padding) are
left alone. The same op serves both halves of a LoRA delta: the shrink (x @ A.T, into a
[T, parts * rank] buffer) and the expand (h @ B.T, added onto the layer's output).
"""

from __future__ import annotations

import torch


def segment_matmul_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    starts: list[int],
    lens: list[int],
    slots: list[int],
    accumulate: bool,
) -> torch.Tensor:
    """out[seg] (+)= x[seg] @ weights[slot].T for every segment; x [T, K], weights [S, N, K],
    out [T, N]. Products in float32, rounded to `out`'s dtype once. Returns `out`."""
    for start, length, slot in zip(starts, lens, slots):
        rows = slice(start, start + length)
        product = x[rows].float() @ weights[slot].float().t()
        if accumulate:
            product += out[rows].float()
        out[rows] = product.to(out.dtype)
    return out
