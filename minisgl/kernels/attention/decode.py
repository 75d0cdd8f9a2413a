"""Triton split-K paged decode attention: one query token per request; each (request, KV
head) is cut into splits read in parallel (stage 1), merged by their log-sum-exps (stage 2).
With a sliding window the splits divide only the keys still inside it; a soft-cap bends the
scores before softmax (both compile-time variants, see `common`). Attention sinks (a logit per
q head in the softmax denominator) join at the end: in stage 1 when there is one split, else in
the merge, as one more split with no value."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.attention.common import (
    _SMALL_BLOCKS,
    _attend_block,
    _block_d,
    _check_layout,
    _precision,
    _score_scales,
)
from minisgl.kernels.impl import num_sms
from minisgl.kernels.pdl import pdl_args

# Upper bound on decode splits per (request, kv head). On an H200 a lone 32k-token request still
# gained going from 32 to 64 splits (Hkv 8, D 128: 55 -> 51 us; Hkv 3, D 64: 47 -> 30 us).
MAX_DECODE_SPLITS = 64
# A split shorter than this spends more time on its launch share and the reduce than on KV loads.
_MIN_TOKENS_PER_SPLIT = 128
# Decode programs wanted per SM for a 128-wide head (more for narrower heads, which move fewer
# bytes per token). 4 was best on an H200 for equal lengths (batch 1..64, 2k..32k tokens); with
# requests started longest first on workload-like lengths (100..2048, `sweep_decode_attention.py
# --ragged`) 64 requests run 7% faster on 2 splits than on 1, and the issue-10 workload ~2% faster
# with 8 (two A/B pairs in one lease: 24.8k/25.3k vs 25.5k/25.5k tok/s). 12 was tried: on the
# workload's own batches (`--workload`) the extra splits pay only with 2 pipeline stages, and with
# the 3 that split launches run, 77 requests took 110.1 us on 2 splits against 104.7 on 1.
_DECODE_PROGRAMS_PER_SM = 8

# How a float8 cache's tiles are widened for the two dots (`decode_attention(fp8_route=...)`):
# "q": to q's dtype (bf16: e4m3 -> f16 -> bf16, two conversions per element); "f16": to f16, with
# q cast to f16 (one cvt.rn.f16x2.e4m3x2 per pair; f16 holds every e4m3 value, and every bf16 q
# component in 2^-17..65504, q being clamped to +-65504; the probabilities round to f16, finer
# than bf16's); "-staged": v widened before its shared-memory stage (common._attend_block's
# V_STAGED). sm90 SASS of the stage-1 loop, 64 keys, 2 warps (Triton 3.6, compiled on CPU for
# sm_90): bf16 pages 725 instructions; float8 "q" 1527 (256 F2F, 128 PRMT, 167 LDS: v's transposed
# operand read a byte at a time); "f16" 1116; "f16-staged" 1056 (v through LDSM.T as f16).
FP8_ROUTES = ("q", "q-staged", "f16", "f16-staged")
FP8_ROUTE = "f16-staged"


@triton.jit
def _split_range(first, seq_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions [start, end) of `split`: the keys from `first` to `seq_len` divided over the
    splits in whole blocks. A short request leaves trailing splits empty (start >= end): they only
    write (lse = -inf, o = 0), which the reduce ignores. Shared with `mla_decode`."""
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    return start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _store_split(
    out, m_i, l_i, o_ptr, mid_o_ptr, mid_lse_ptr, req, heads, split, offs_d, out_mask, h_mask,
    stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """A split's normalised partial output `out` [BLOCK_H, BLOCK_D]: with one split the answer,
    straight to `o` (seq_len 0, a padded graph entry, gives 0, as stage 2 would); else to the fp32
    scratch with its base-2 log-sum-exp (-inf for an empty split). Shared with `mla_decode`."""
    if NUM_SPLITS == 1:
        o_ptrs = o_ptr + req.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        mo_ptrs = mid_o_ptr + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
        tl.store(mo_ptrs, out, mask=out_mask)
        tl.store(mid_lse_ptr + req * stride_mlb + heads * stride_mlh + split, lse, mask=h_mask)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    table_ptr,
    rows_ptr,
    seq_lens_ptr,
    order_ptr,
    sinks_ptr,
    qk_scale,
    cap_scale,
    v_scale,
    window,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr,
    Q_F16: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    """Stage 1: partial attention of all q heads of one kv head over one split of the sequence.
    With a single split the partial result is the answer: it goes straight to `o` (no stage 2).

    Programs start in grid order, KV heads fastest, and with HAS_ORDER the i-th request taken is
    `order[i]`: given longest-first, the long requests start first and the GPU does not idle
    waiting on a few long ones started last (at one split a program reads a whole sequence)."""
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    kv_head = tl.program_id(0)
    req = tl.load(order_ptr + tl.program_id(1)) if HAS_ORDER else tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    row = tl.load(rows_ptr + req).to(tl.int64)
    # Each request divides its own length over the splits, in whole blocks. WINDOWED: the query
    # (position seq_len - 1) sees the last `window` keys, all of them, so the splits divide just
    # those and need no extra mask.
    first = tl.maximum(seq_len - window, 0) if WINDOWED else 0
    start, end = _split_range(first, seq_len, split, NUM_SPLITS, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if Q_F16:  # a float8 cache's "f16" route: the dots run in f16 (FP8_ROUTE)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SINKS and NUM_SPLITS == 1:  # the whole answer here: the sink starts the running max / sum
        m_i = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i += 1.0
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    table_row_ptr = table_ptr + row * stride_table
    for block_start in range(start, end, BLOCK_N):
        kv_pos = block_start + offs_n
        kv_mask = kv_pos < end
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, kv_pos, kv_mask,
            kv_mask[None, :], offs_d, d_mask, stride_ks, stride_vs, qk_scale, cap_scale, PRECISION, SOFTCAP, V_STAGED,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # v_scale: a float8 cache's
    _store_split(
        out, m_i, l_i, o_ptr, mid_o_ptr, mid_lse_ptr, req, heads, split, offs_d, h_mask[:, None] & d_mask[None, :],
        h_mask, stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    sinks_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 2: merge the splits of one (request, q head) by their log-sum-exp weights."""
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + req * stride_mlb + head * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if SINKS:  # the sink: one more split, of log-sum-exp sinks[head] (base 2) and no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
        weights = tl.exp2(lse - lse_max)
        total = tl.sum(weights, 0) + tl.exp2(sink - lse_max)
    else:
        # seq_len 0 (a padded graph entry) empties every split: output 0 rather than NaN.
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        weights = tl.exp2(lse - lse_max)
        total = tl.sum(weights, 0)
    mo_ptrs = mid_o_ptr + req * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :]
    parts = tl.load(mo_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + req * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def decode_num_splits(
    batch_size: int, num_kv_heads: int, head_dim: int, max_seq_len: int | None, device: torch.device
) -> int:
    """Splits per (request, kv head): enough programs to keep every SM busy, none shorter than
    `_MIN_TOKENS_PER_SPLIT`. `max_seq_len=None` (CUDA-graph capture, where lengths vary per
    replay) assumes a long context; the kernel leaves surplus splits empty for short requests.

    A power of two: the count is a compile-time constant of both kernels, and eager decode (no
    graphs, batches past the largest graph, the decodes of mixed steps) would otherwise compile
    a variant for nearly every count from 1 to 64 the first time it comes up, mid-run (an H200
    spent seconds of a graphs-off benchmark compiling them)."""
    programs = _DECODE_PROGRAMS_PER_SM * num_sms(device) * 128 // min(128, max(64, head_dim))
    splits = programs // max(1, batch_size * num_kv_heads)
    if max_seq_len is not None:
        splits = min(splits, triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT))
    splits = max(1, min(MAX_DECODE_SPLITS, splits))
    return 1 << (splits.bit_length() - 1)


class DecodeLaunch(NamedTuple):
    """A decode attention launch: the split count and the stage-1 kernel's tile and pipeline
    (None: `decode_attention`'s defaults)."""

    num_splits: int
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def alloc_decode_buffers(
    batch_size: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [B, Hq, splits, D] and log-sum-exps [B, Hq, splits] for stage 1."""
    mid_o = torch.empty(batch_size, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    num_splits: int,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_route: str | None = None,
) -> torch.Tensor:
    """One query token per request, q [B, Hq, D], attending to all `seq_lens[b]` cached positions
    (with `window`, only the last `window` of them; `softcap`: `cap * tanh(s / cap)` scores;
    `sinks` [Hq]: a logit per q head in the softmax denominator).

    `num_splits` is a launch constant (no data-dependent grid, so CUDA graphs can capture it).
    `mid_o`/`mid_lse` may be larger than needed (static graph buffers): only [:B, :, :num_splits]
    is touched. `order` [B] int32, a permutation of the requests, is the order their programs
    start in (longest first pays: see the kernel). `block_n`/`num_warps`/`num_stages` override the
    tuned launch (sweeps). `fp8_route` (a float8 cache; default FP8_ROUTE for a 16-bit q, "q" for
    fp32) picks how its tiles are widened (see FP8_ROUTES).
    """
    num_heads, num_kv_heads, head_dim = _check_layout(q, k_cache, v_cache)
    assert 1 <= num_splits
    assert window is None or window > 0, window
    assert sinks is None or sinks.shape == (num_heads,), "sinks: one logit per q head"
    if out is None:
        out = torch.empty_like(q)
    batch_size = q.shape[0]
    if batch_size == 0:
        return out
    if mid_o is None or mid_lse is None:
        mid_o, mid_lse = alloc_decode_buffers(batch_size, num_heads, head_dim, num_splits, q.device)
    assert mid_o.shape[0] >= batch_size and mid_o.shape[2] >= num_splits and mid_o.stride(3) == 1
    assert mid_lse.shape[2] >= num_splits and mid_lse.stride(2) == 1
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    block_n = block_n or (16 if _SMALL_BLOCKS else 32 if head_dim > 128 else 64)
    assert order is None or order.shape[0] >= batch_size
    route = "q"
    if k_cache.dtype == torch.float8_e4m3fn:  # f16 dots are exact for a 16-bit q only: fp32 keeps "q"
        route = fp8_route or (FP8_ROUTE if q.dtype.itemsize == 2 else "q")
    assert route in FP8_ROUTES, f"fp8_route {route!r}: one of {FP8_ROUTES}"
    _decode_split_kernel[(num_kv_heads, batch_size, num_splits)](
        q, k_cache, v_cache, mid_o, mid_lse, out,
        token_table, rows, seq_lens, order if order is not None else rows, sinks if sinks is not None else q,
        *_score_scales(sm_scale * k_scale, softcap), v_scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), token_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        HAS_ORDER=order is not None,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        Q_F16=route.startswith("f16"),
        V_STAGED=route.endswith("-staged"),
        # H200 sweep of uniform lengths: 2 warps best or tied from batch 1 to 256 (4 warps up to 10%
        # slower at D 64, 8 warps up to 60% slower); wider heads get 4 to keep tiles in registers.
        num_warps=num_warps or (2 if head_dim <= 128 else 4),
        # H200, the offline workload's own decode batches (`sweep_decode_attention.py --workload`):
        # at one split, 2 stages (64 KB of shared memory, 3 programs per SM instead of 2) read
        # 4.2 TB/s where 3 stages read 4.0 (155-218 requests); with several splits 3 stages tie.
        # Float8 pages (half the bytes per tile), "f16-staged": 3 stages best at every batch
        # measured (`tools/bench_fp8_decode.py`: 256 requests 117 us vs 137 at 2 stages, bf16 149;
        # 155: 108 vs 141, bf16 141; 59 on 2 splits 72 vs 81, bf16 87; bs=1 7.3 vs 7.5, bf16 7.7).
        num_stages=num_stages or (3 if route != "q" or num_splits > 1 else 2),
        **pdl_args(q.device),
    )  # fmt: skip
    if num_splits == 1:
        return out
    _decode_reduce_kernel[(batch_size, num_heads)](
        mid_o, mid_lse, out, sinks if sinks is not None else q,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_POW2=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SINKS=sinks is not None,
        num_warps=4 if head_dim >= 128 else 2,
        **pdl_args(q.device),
    )  # fmt: skip
    return out
