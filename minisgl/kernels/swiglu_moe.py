"""Fused routed experts with biases and GPT-OSS's clamped SwiGLU, in two launches (plus the sort of
`kernels/moe.py`, whose tiling it shares): every expert's gate_up GEMM + bias + activation, then
every expert's down GEMM + bias scaled by the routing weight. Same contract as
`swiglu_moe_ref.swiglu_moe_ref`; no host reads, so CUDA graphs can capture it.

Rounding follows the reference (transformers' GptOssExperts): the GEMM outputs round to the
activation dtype before their bias is added, the activation rounds once, the down projection plus
its bias rounds before the routing weight scales it; the top-k products are summed in k order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.moe import _tiling, align_by_expert


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch
def _gate_up_clamped_kernel(
    x_ptr,
    w_ptr,
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
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc_gate = tl.dot(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

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
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)
        out = (out + bias[None, :]).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, (out * weight[:, None]).to(dtype), mask=row_mask[:, None] & col_mask[None, :])


def swiglu_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; b13 [E, 2I]; w2 [E, H, I]; b2 [E, H] or None; topk_weights
    [T, K]; topk_ids [T, K] -> [T, H] (see `swiglu_moe_ref`)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    assert hidden.shape == (num_tokens, hidden_size) and hidden.stride(-1) == 1
    assert w2.shape == (num_experts, hidden_size, inter) and b13.shape == (num_experts, two_inter)
    assert b13.stride(-1) == 1 and (b2 is None or (b2.shape == (num_experts, hidden_size) and b2.stride(-1) == 1))
    num_pairs = num_tokens * top_k
    out_pairs = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out_pairs.view(num_tokens, hidden_size)
    tiling = _tiling(num_pairs, num_experts, hidden.dtype)
    tiles = align_by_expert(topk_ids, num_experts, tiling.block_m)
    num_tiles = tiles.tile_expert.numel()
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # fp32: parity with HF
    blocks = {"BLOCK_M": tiling.block_m, "BLOCK_N": tiling.block_n, "BLOCK_K": tiling.block_k, "PRECISION": precision}
    launch = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages}

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_clamped_kernel[(num_tiles, triton.cdiv(inter, tiling.block_n))](
        hidden, w13, b13, act, tiles.sorted_pairs, tiles.tile_expert, num_pairs, float(limit), float(alpha),
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), b13.stride(0), act.stride(0),
        N=inter, K=hidden_size, NUM_EXPERTS=num_experts, TOP_K=top_k, **blocks, **launch,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).to(hidden.dtype)
    bias = b2 if b2 is not None else b13  # a placeholder pointer when HAS_BIAS is off
    _down_bias_kernel[(num_tiles, triton.cdiv(hidden_size, tiling.block_n))](
        act, w2, bias, out_pairs, weights, tiles.sorted_pairs, tiles.tile_expert, num_pairs,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), bias.stride(0), out_pairs.stride(0),
        N=hidden_size, K=inter, NUM_EXPERTS=num_experts, HAS_BIAS=b2 is not None, **blocks, **launch,
    )  # fmt: skip
    if top_k == 1:
        return out_pairs
    return out_pairs.view(num_tokens, top_k, hidden_size).sum(dim=1)
