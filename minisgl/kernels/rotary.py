"""Neox rotary for q and k in one launch, optionally fused with Qwen3's per-head q/k RMSNorm.

Eager torch spends a table gather, casts, three `cat`s, muls and adds per tensor (and ~8 kernels
per head norm). Here each program takes a block of heads of one token straight from the fused
qkv buffer (any token/head strides), normalises them if asked, rotates them and writes them:
to new tensors, or (`rotary_store_kv`) k and v straight into their KV-cache slots, which saves the
attention backend's store launch.
Rounding is written to follow `rotary_ref.py` (HF): the fp32 cos/sin row is cast to q's dtype and
each product and the sum round to that dtype. The interpreter reproduces eager torch bit for bit;
compiled on an H200, 16-bit results sit within one ulp of it but 17-20% of elements differ
(`scripts/diag_rotary.py`, `test_gpu_rotary_rounds_like_eager`, a known gap). No host reads: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.norm import row_norm_args, row_rms_scale
from minisgl.kernels.pdl import pdl_args

# Head-block size in elements: decode (a few tokens) still gets a few programs per token, and
# prefill does not launch T * H programs of one head each.
_TILE_ELEMS = 1024


@triton.jit
def _rope_heads(
    x_ptr,
    out_ptr,
    w_ptr,
    round_ptr,
    token,
    out_row,
    head_start,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos,
    sin,
    eps,
    row_scale,
    inv_scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    SCALED: tl.constexpr,
    FP8: tl.constexpr,
):
    heads = head_start + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
    x_offs = token * stride_xt + heads.to(tl.int64)[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = round_ptr.dtype.element_ty  # the output's compute dtype (a float8 cache rounds in it first)
    in_dtype = x_ptr.dtype.element_ty
    if SCALED:  # the projection ran on the un-normalised hidden row: apply its RMSNorm scale now
        x1 = (x1 * row_scale).to(in_dtype).to(tl.float32)
        x2 = (x2 * row_scale).to(in_dtype).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.math.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd).to(in_dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(in_dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # out1 = x1*cos + (-x2)*sin, out2 = x2*cos + x1*sin, each term rounded as eager torch does.
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + ((-x2) * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    out_offs = out_row * stride_ot + heads.to(tl.int64)[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, _to_cache(out1, inv_scale, out_ptr, FP8), mask=mask)
    tl.store(out_ptr + out_offs + HALF, _to_cache(out2, inv_scale, out_ptr, FP8), mask=mask)


@triton.jit
def _to_cache(x, inv_scale, out_ptr, FP8: tl.constexpr):
    """x (rounded to its compute dtype) in the output's element type; a float8 KV cache holds
    x / scale saturated at +-448, as `store_kv` writes it (kernels/store_kv.py)."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    v_ptr,
    v_out_ptr,
    loc_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_vt,
    stride_vh,
    stride_vot,
    stride_voh,
    q_eps,
    k_eps,
    h_ptr,
    stride_ht,
    h_eps,
    inv_k_scale,
    inv_v_scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dtype = q_out_ptr.dtype.element_ty
    # The fp32 table row, cast to the compute dtype as `cos[positions].to(q.dtype)` is.
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dims < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + dims, mask=dims < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    num_k_blocks = tl.cdiv(num_k_heads, BLOCK_H)
    # With STORE_KV, k (rotated) and v go straight to their cache slot: row `loc[token]` of the
    # k/v outputs, which are then the layer's KV pool (the separate store kernel is saved).
    kv_row = tl.load(loc_ptr + token).to(tl.int64) if STORE_KV else token
    # HIDDEN > 0: q, k and v were projected from the un-normalised hidden row h (the input RMSNorm
    # weight folded into the projection), so they take the norm's 1 / rms(h) here (`row_scale`).
    row_scale = 1.0
    if HIDDEN > 0:
        row_scale = row_rms_scale(h_ptr, token, stride_ht, h_eps, HIDDEN, BLOCK_HIDDEN)
    # Axis 1 covers q's head blocks, then k's, then (STORE_KV) v's: one launch for all.
    if block < num_q_blocks:
        _rope_heads(
            q_ptr, q_out_ptr, qw_ptr, q_out_ptr, token, token, block * BLOCK_H, num_q_heads,
            stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, q_eps, row_scale, 1.0,
            HALF, BLOCK_H, BLOCK_HALF, HAS_NORM, HIDDEN > 0, False,
        )  # fmt: skip
    elif block < num_q_blocks + num_k_blocks:
        _rope_heads(
            k_ptr, k_out_ptr, kw_ptr, q_out_ptr, token, kv_row, (block - num_q_blocks) * BLOCK_H, num_k_heads,
            stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, k_eps, row_scale, inv_k_scale,
            HALF, BLOCK_H, BLOCK_HALF, HAS_NORM, HIDDEN > 0, FP8,
        )  # fmt: skip
    else:
        heads = (block - num_q_blocks - num_k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        full = tl.arange(0, 2 * BLOCK_HALF)
        mask = (heads < num_k_heads)[:, None] & (full < 2 * HALF)[None, :]
        heads = heads.to(tl.int64)[:, None]
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + full[None, :], mask=mask)
        if HIDDEN > 0:
            v = (v.to(tl.float32) * row_scale).to(v_ptr.dtype.element_ty) if FP8 else v.to(tl.float32) * row_scale
        v_dst = v_out_ptr + kv_row * stride_vot + heads * stride_voh + full[None, :]
        tl.store(v_dst, _to_cache(v, inv_v_scale, v_out_ptr, FP8), mask=mask)


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float, float] | None,
    inplace: bool,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    row_norm: tuple[torch.Tensor, float] | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch for all entry points -> (q out, k out); `store` = (v, k_cache, v_cache, out_loc)
    sends k and v to the cache, which is then the k out (a float8 cache: divided by `kv_scales`
    and saturated, after rounding to the compute dtype); `row_norm` = (hidden [T, H], eps) scales
    q, k and v by each token's 1 / rms(hidden) first."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = head_dim // 2
    assert k.shape == (num_tokens, num_k_heads, head_dim) and head_dim % 2 == 0 and positions.shape == (num_tokens,)
    assert q.dtype == k.dtype and q.stride(2) == 1 and k.stride(2) == 1, "head dims must be contiguous"
    assert cos.shape == sin.shape and cos.shape[1] == half and cos.stride() == sin.stride() and cos.stride(1) == 1
    out_dtype = q.dtype
    if norm is not None:
        q_weight, k_weight = norm[0], norm[1]
        assert q_weight.shape == (head_dim,) == k_weight.shape and q_weight.dtype == k_weight.dtype
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
        out_dtype = torch.promote_types(q.dtype, q_weight.dtype)
    if inplace:
        assert out_dtype == q.dtype and store is None, "in place needs a norm weight no wider than q, and no store"
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device) if store is None else store[1]
    v, v_out, loc = q, q, positions  # placeholders, never read without a store
    if store is not None:
        v, _, v_out, loc = store
        assert v.shape == k.shape and v.stride(2) == 1 and loc.shape == (num_tokens,)
        assert k_out.shape[1:] == k.shape[1:] and v_out.shape == k_out.shape and k_out.stride(2) == v_out.stride(2) == 1
        assert k_out.dtype in (out_dtype, torch.float8_e4m3fn), "the cache dtype must be the rotated k's, or float8"
    if num_tokens == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(_TILE_ELEMS // (2 * block_half), triton.next_power_of_2(max(num_q_heads, num_k_heads))))
    k_blocks = triton.cdiv(num_k_heads, block_h)
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + k_blocks * (2 if store is not None else 1))
    # Without a norm the weight pointers are never read; q stands in for them.
    q_weight, k_weight, q_eps, k_eps = norm if norm is not None else (q, q, 0.0, 0.0)
    _rotary_kernel[grid](
        q, k, q_out, k_out, q_weight, k_weight, positions, cos, sin, v, v_out, loc,
        num_q_heads, num_k_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), v.stride(0), v.stride(1), v_out.stride(0), v_out.stride(1), q_eps, k_eps,
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, HAS_NORM=norm is not None, STORE_KV=store is not None,
        **row_norm_args(row_norm, num_tokens, q),
        inv_k_scale=1.0 / kv_scales[0], inv_v_scale=1.0 / kv_scales[1], FP8=k_out.dtype == torch.float8_e4m3fn,
        num_warps=max(1, min(4, block_h * block_half // 128)),
        **pdl_args(q.device),
    )  # fmt: skip
    return q_out, k_out


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (any token/head strides), positions [T] (int32/int64), fp32
    tables cos/sin [max_positions, D/2] -> rotated (q, k): new contiguous tensors, or q and k
    themselves with `inplace`."""
    return _launch(positions, q, k, cos, sin, None, inplace)


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary` after a per-head RMSNorm of q and k (weights [D]), all in one launch."""
    return _launch(positions, q, k, cos, sin, (q_weight, k_weight, q_eps, k_eps), inplace)


def rotary_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
    row_norm: tuple[torch.Tensor, float] | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """`rotary` / `qk_norm_rotary` (with `norm` = (q_weight, k_weight, q_eps, k_eps)) whose k, and
    v unchanged, are written to slots `out_loc` [T] of the layer caches [slots, Hk, D] in the same
    launch, which replaces `store_kv`. Returns the rotated q. A float8 cache gets k and v (in the
    compute dtype) divided by `kv_scales` = (k_scale, v_scale) and saturated, as `store_kv` writes.

    `row_norm` = (hidden [T, H], eps): q, k and v were projected from the un-normalised `hidden`
    with the input RMSNorm's weight folded into the projection; each token's are first scaled by
    1 / rms(hidden) (and rounded to their dtype), which completes that norm."""
    return _launch(positions, q, k, cos, sin, norm, False, (v, k_cache, v_cache, out_loc), row_norm, kv_scales)[0]
