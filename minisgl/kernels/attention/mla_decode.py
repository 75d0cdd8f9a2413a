"""Triton paged decode for multi-head latent attention (absorbed form), split-K.

Every head of a request attends over the same cached vectors [c (L = kv_lora_rank), k_rope (R)]:
a program takes BLOCK_H heads of one request over one split of its positions, reads each cached
vector once for all of them (the latent is both key and value), and keeps an online softmax in
fp32. The splits are merged by their log-sum-exps with the GQA decode's reduce kernel
(`decode._decode_reduce_kernel`, over the latent's L values). The plain-torch oracle is
`kernels/mla_ref.py`.

The split count is a launch constant (default: `decode_num_splits` for a long context), so CUDA
graphs capture the launch; requests shorter than the splits leave trailing splits empty, and a
request of length 0 (a padded graph entry) outputs zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.attention.common import _LOG2E, _SMALL_BLOCKS, _block_d, _precision
from minisgl.kernels.attention.decode import (
    _decode_reduce_kernel,
    _split_range,
    _store_split,
    alloc_decode_buffers,
    decode_num_splits,
)
from minisgl.kernels.pdl import pdl_args


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,
    cache_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    table_ptr,
    rows_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    stride_table,
    NUM_HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 1: BLOCK_H heads of request `program_id(1)` over split `program_id(2)`. One split:
    the normalised result goes straight to `o`."""
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    head_block = tl.program_id(0)
    req = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    row = tl.load(rows_ptr + req).to(tl.int64)
    start, end = _split_range(0, seq_len, split, NUM_SPLITS, BLOCK_N)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = heads < NUM_HEADS
    l_mask = offs_l < LATENT
    r_mask = offs_r < ROPE
    q_row = q_ptr + req.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_rope = tl.load(q_row + LATENT + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table_row = table_ptr + row * stride_table
    for block_start in range(start, end, BLOCK_N):
        kv_pos = block_start + offs_n
        kv_mask = kv_pos < end
        # int64 before scaling by the slot stride: large pools overflow int32 element offsets.
        slots = tl.load(table_row + kv_pos, mask=kv_mask, other=0).to(tl.int64)
        vec = cache_ptr + slots[:, None] * stride_cs
        latent = tl.load(vec + offs_l[None, :], mask=kv_mask[:, None] & l_mask[None, :], other=0.0).to(q_lat.dtype)
        k_rope = tl.load(vec + LATENT + offs_r[None, :], mask=kv_mask[:, None] & r_mask[None, :], other=0.0)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope.to(q_rope.dtype)), input_precision=PRECISION)
        scores = tl.where(kv_mask[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    _store_split(
        out, m_i, l_i, o_ptr, mid_o_ptr, mid_lse_ptr, req, heads, split, offs_l, h_mask[:, None] & l_mask[None, :],
        h_mask, stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, NUM_SPLITS,
    )  # fmt: skip


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [B, H, L + R] (absorbed latent query, then its rotated rope part); cache [slots, L + R]
    -> [B, H, L]: request b attends over slots token_table[rows[b], :seq_lens[b]]."""
    assert q.dim() == 3 and cache.dim() == 2 and q.shape[2] == cache.shape[1] > kv_lora_rank
    assert q.stride(2) == 1 and cache.stride(1) == 1 and cache.dtype == q.dtype
    batch_size, num_heads, width = q.shape
    rope = width - kv_lora_rank
    out = q.new_empty(batch_size, num_heads, kv_lora_rank)
    if batch_size == 0:
        return out
    if num_splits is None:  # the interpreter runs programs one by one: two splits exercise the merge
        num_splits = 2 if _SMALL_BLOCKS else decode_num_splits(batch_size, triton.cdiv(num_heads, 16), kv_lora_rank,
                                                                None, q.device)  # fmt: skip
    mid_o, mid_lse = alloc_decode_buffers(batch_size, num_heads, kv_lora_rank, num_splits, q.device)
    block_h = 16 if not _SMALL_BLOCKS else max(1, min(16, triton.next_power_of_2(num_heads)))
    block_l = _block_d(kv_lora_rank)
    _mla_decode_split_kernel[(triton.cdiv(num_heads, block_h), batch_size, num_splits)](
        q, cache, mid_o, mid_lse, out, token_table, rows, seq_lens, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), cache.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), token_table.stride(0),
        NUM_HEADS=num_heads,
        LATENT=kv_lora_rank,
        ROPE=rope,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_h,
        BLOCK_L=block_l,
        BLOCK_R=_block_d(rope),
        # A [BLOCK_N, 512] latent tile and the [16, 512] fp32 accumulator share the registers.
        BLOCK_N=block_n or (16 if _SMALL_BLOCKS or kv_lora_rank > 128 else 32),
        PRECISION=_precision(q.dtype),
        num_warps=4 if kv_lora_rank <= 256 else 8,
        num_stages=2,
        **pdl_args(q.device),
    )  # fmt: skip
    if num_splits == 1:
        return out
    _decode_reduce_kernel[(batch_size, num_heads)](
        mid_o, mid_lse, out, out,  # no sinks (the pointer is never read)
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_POW2=triton.next_power_of_2(num_splits),
        HEAD_DIM=kv_lora_rank,
        BLOCK_D=block_l,
        SINKS=False,
        num_warps=4,
        **pdl_args(q.device),
    )  # fmt: skip
    return out
