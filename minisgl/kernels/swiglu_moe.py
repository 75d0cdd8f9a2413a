"""Fused routed experts with biases and GPT-OSS's clamped SwiGLU: the launches, tiling and K loop
of `kernels/moe.py` (`run_experts`), with its CLAMPED activation and the down bias. Same contract
as `swiglu_moe_ref.swiglu_moe_ref`; no host reads, so CUDA graphs can capture it.

Rounding follows the reference (transformers' GptOssExperts): the GEMM outputs round to the
activation dtype before their bias is added, the activation rounds once, the down projection plus
its bias rounds before the routing weight scales it; the top-k products are summed in k order.

MXFP4: the expert weights stay as shipped (4-bit E2M1 codes, two per byte, and an E8M0 scale per
32 inputs; `kernels/mxfp4.py`), a quarter of bf16's bytes, and each weight tile is dequantized in
registers before its dot (`moe._weight_tile`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minisgl.kernels.moe import ExpertWeights, dense_weights, run_experts


class Mxfp4Weights(NamedTuple):
    """Experts' weights as shipped: codes [E, rows, in / 2] and scales [E, rows, in / 32], uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        num_experts, rows, half = self.blocks.shape
        return num_experts, rows, 2 * half


def _expert_weights(w: torch.Tensor | Mxfp4Weights) -> ExpertWeights:
    if isinstance(w, Mxfp4Weights):
        blocks, scales = w
        assert blocks.dtype == scales.dtype == torch.uint8 and blocks.stride(2) == 1 and scales.stride(2) == 1
        assert scales.shape[:2] == blocks.shape[:2] and scales.shape[2] * 16 == blocks.shape[2]
        strides = (blocks.stride(0), blocks.stride(1), 1, scales.stride(0), scales.stride(1))
        return ExpertWeights(blocks, scales, strides, True, w.shape)
    return dense_weights(w)


def swiglu_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weights,
    b13: torch.Tensor,
    w2: torch.Tensor | Mxfp4Weights,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; b13 [E, 2I]; w2 [E, H, I]; b2 [E, H] or None; topk_weights
    [T, K]; topk_ids [T, K] -> [T, H] (see `swiglu_moe_ref`). w13 and w2 may be `Mxfp4Weights`
    (both or neither)."""
    return run_experts(hidden, _expert_weights(w13), _expert_weights(w2), topk_weights, topk_ids,
                       b13=b13, b2=b2, clamp=(limit, alpha))  # fmt: skip
