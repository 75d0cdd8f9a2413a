"""Fused routed experts with biases and GPT-OSS's clamped SwiGLU, in two launches (plus the sort of
`kernels/moe.py`, whose tiling it shares): every expert's gate_up GEMM + bias + activation, then
every expert's down GEMM + bias scaled by the routing weight. Same contract as
`swiglu_moe_ref.swiglu_moe_ref`; no host reads, so CUDA graphs can capture it.

Rounding follows the reference (transformers' GptOssExperts): the GEMM outputs round to the
activation dtype before their bias is added, the activation rounds once, the down projection plus
its bias rounds before the routing weight scales it; the top-k products are summed in k order.

MXFP4: the expert weights stay as shipped (4-bit E2M1 codes, two per byte, and an E8M0 scale per
32 inputs; `kernels/mxfp4.py`), a quarter of bf16's bytes, and each weight tile is dequantized in
registers before its dot (exactly: every value is representable in bf16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.moe import _tiling, align_by_expert


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, stride_wn, stride_wk, stride_sn, k0, ks, mask, MXFP4: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of weight rows `rows`, inputs k0 + ks, in fp32 (MXFP4) or the
    weights' dtype. MXFP4: w_ptr are the packed codes [.., rows, in / 2] (even input in the low
    nibble), s_ptr the scales [.., rows, in / 32] (2^(s - 127))."""
    kk = k0 + ks
    if MXFP4:
        packed = tl.load(w_ptr + rows[None, :] * stride_wn + (kk // 2)[:, None], mask=mask, other=0).to(tl.int32)
        code = tl.where((kk % 2 == 0)[:, None], packed & 15, packed >> 4)
        exp = (code >> 1) & 3
        man = (code & 1).to(tl.float32)
        # E2M1: exponent 0 is subnormal (0, 0.5), else (1 + m / 2) * 2^(e - 1)
        mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
        value = tl.where((code & 8) != 0, -mag, mag)
        scale = tl.load(s_ptr + rows[None, :] * stride_sn + (kk // 32)[:, None], mask=mask, other=127)
        tile = value * tl.exp2((scale.to(tl.int32) - 127).to(tl.float32))
    else:
        tile = tl.load(w_ptr + rows[None, :] * stride_wn + kk[:, None] * stride_wk, mask=mask, other=0.0)
    return tile


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch
def _gate_up_clamped_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_pairs,
    limit,
    alpha,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_ot,
    N: tl.constexpr,  # intermediate size per rank: w holds N gate rows then N up rows
    K: tl.constexpr,  # hidden size
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    MXFP4: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    s_expert = s_ptr + expert.to(tl.int64) * stride_se
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate_w = _weight_tile(w_expert, s_expert, cols, stride_wn, stride_wk, stride_sn, k0, ks, w_mask, MXFP4)
        up_w = _weight_tile(w_expert, s_expert, cols + N, stride_wn, stride_wk, stride_sn, k0, ks, w_mask, MXFP4)
        acc_gate = tl.dot(x, gate_w.to(x.dtype), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, up_w.to(x.dtype), acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    b_row = b_ptr + expert.to(tl.int64) * stride_be
    b_gate = tl.load(b_row + cols, mask=col_mask, other=0.0).to(tl.float32)
    b_up = tl.load(b_row + N + cols, mask=col_mask, other=0.0).to(tl.float32)
    gate = (acc_gate.to(dtype).to(tl.float32) + b_gate[None, :]).to(dtype).to(tl.float32)
    up = (acc_up.to(dtype).to(tl.float32) + b_up[None, :]).to(dtype).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    glu = gate / (1.0 + tl.exp(-gate * alpha))
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, ((up + 1.0) * glu).to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch
def _down_bias_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_ot,
    N: tl.constexpr,  # hidden size
    K: tl.constexpr,  # intermediate size per rank
    NUM_EXPERTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # False on TP ranks other than the first
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    MXFP4: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    pairs = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + pairs[:, None] * stride_xt + ks[None, :]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    s_expert = s_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = _weight_tile(w_expert, s_expert, cols, stride_wn, stride_wk, stride_sn, k0, ks, w_mask, MXFP4)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)
        out = (out + bias[None, :]).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, (out * weight[:, None]).to(dtype), mask=row_mask[:, None] & col_mask[None, :])


class Mxfp4Weights(NamedTuple):
    """Experts' weights as shipped: codes [E, rows, in / 2] and scales [E, rows, in / 32], uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        num_experts, rows, half = self.blocks.shape
        return num_experts, rows, 2 * half


def _weight_args(w: torch.Tensor | Mxfp4Weights) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(weights, scales, (stride_we, stride_wn, stride_wk, stride_se, stride_sn)) for a kernel."""
    if isinstance(w, Mxfp4Weights):
        blocks, scales = w
        assert blocks.dtype == scales.dtype == torch.uint8 and blocks.stride(2) == 1 and scales.stride(2) == 1
        assert scales.shape[:2] == blocks.shape[:2] and scales.shape[2] * 16 == blocks.shape[2]
        return blocks, scales, (blocks.stride(0), blocks.stride(1), 1, scales.stride(0), scales.stride(1))
    return w, w, (w.stride(0), w.stride(1), w.stride(2), 0, 0)


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
    mxfp4 = isinstance(w13, Mxfp4Weights)
    assert mxfp4 == isinstance(w2, Mxfp4Weights), "both expert weights MXFP4, or neither"
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    assert hidden.shape == (num_tokens, hidden_size) and hidden.stride(-1) == 1
    assert tuple(w2.shape) == (num_experts, hidden_size, inter) and b13.shape == (num_experts, two_inter)
    assert b13.stride(-1) == 1 and (b2 is None or (b2.shape == (num_experts, hidden_size) and b2.stride(-1) == 1))
    num_pairs = num_tokens * top_k
    out_pairs = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out_pairs.view(num_tokens, hidden_size)
    tiling = _tiling(num_pairs, num_experts, hidden.dtype)
    tiles = align_by_expert(topk_ids, num_experts, tiling.block_m)
    num_tiles = tiles.tile_expert.numel()
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # fp32: parity with HF
    blocks = {"BLOCK_M": tiling.block_m, "BLOCK_N": tiling.block_n, "BLOCK_K": tiling.block_k,
              "PRECISION": precision, "MXFP4": mxfp4}  # fmt: skip
    launch = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages}

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    w, s, strides = _weight_args(w13)
    _gate_up_clamped_kernel[(num_tiles, triton.cdiv(inter, tiling.block_n))](
        hidden, w, s, b13, act, tiles.sorted_pairs, tiles.tile_expert, num_pairs, float(limit), float(alpha),
        hidden.stride(0), *strides, b13.stride(0), act.stride(0),
        N=inter, K=hidden_size, NUM_EXPERTS=num_experts, TOP_K=top_k, **blocks, **launch,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).to(hidden.dtype)
    bias = b2 if b2 is not None else b13  # a placeholder pointer when HAS_BIAS is off
    w, s, strides = _weight_args(w2)
    _down_bias_kernel[(num_tiles, triton.cdiv(hidden_size, tiling.block_n))](
        act, w, s, bias, out_pairs, weights, tiles.sorted_pairs, tiles.tile_expert, num_pairs,
        act.stride(0), *strides, bias.stride(0), out_pairs.stride(0),
        N=hidden_size, K=inter, NUM_EXPERTS=num_experts, HAS_BIAS=b2 is not None, **blocks, **launch,
    )  # fmt: skip
    if top_k == 1:
        return out_pairs
    return out_pairs.view(num_tokens, top_k, hidden_size).sum(dim=1)
