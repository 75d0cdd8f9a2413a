"""Triton paged attention: extend (new tokens over a cached prefix) and split-K decode.

Both kernels reach K/V only through the token table (`token_table[row, pos]` is the slot of
position `pos`), so page size never matters here and the new tokens' K/V are read the same way as
the prefix once the backend has stored them. Softmax runs in base 2 (`exp2`) with `sm_scale * log2 e`
folded into the scores, accumulating in fp32. The plain-torch oracle is `attention_ref.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.env import ENV
from minisgl.kernels.impl import num_sms
from minisgl.kernels.pdl import pdl_args

_LOG2E = 1.4426950408889634

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


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_head_ptr,
    v_head_ptr,
    table_row_ptr,
    kv_pos,
    kv_mask,
    score_mask,
    offs_d,
    d_mask,
    stride_ks,
    stride_vs,
    qk_scale,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over a block of key positions; returns the updated (acc, m, l)."""
    # int64 before scaling by the slot stride: large pools overflow int32 element offsets.
    slots = tl.load(table_row_ptr + kv_pos, mask=kv_mask, other=0).to(tl.int64)
    kv_load_mask = kv_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head_ptr + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_load_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    scores = tl.where(score_mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head_ptr + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_load_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    table_ptr,
    rows_ptr,
    seq_lens_ptr,
    extend_lens_ptr,
    extend_starts_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    LAST_BLOCKS_FIRST: tl.constexpr,
    PACK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Without PACK a program is (request, q head, block of BLOCK_M queries). With PACK it is
    (request, KV head, block of BLOCK_M // GROUP queries), its BLOCK_M rows being every q head of
    the group for each query (row r: query r // GROUP, head r % GROUP of the group), so each K/V
    tile loaded serves all the heads that share it."""
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    req = tl.program_id(0)
    head = tl.program_id(1)  # with PACK: the KV head
    QUERIES: tl.constexpr = BLOCK_M // GROUP if PACK else BLOCK_M  # queries per block
    # LAST_BLOCKS_FIRST: query blocks are launched last first. A block's work grows with its
    # position (it reads every key before it): the longest programs start first, the short ones
    # fill in the tail.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2) if LAST_BLOCKS_FIRST else tl.program_id(2)
    m_start = m_block * QUERIES
    extend_len = tl.load(extend_lens_ptr + req)
    # The grid is sized by the longest extend in the batch; shorter requests have idle blocks.
    if m_start >= extend_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - extend_len
    q_start = tl.load(extend_starts_ptr + req).to(tl.int64)
    row = tl.load(rows_ptr + req).to(tl.int64)
    if PACK:
        kv_head = head
        offs_m = m_start + tl.arange(0, BLOCK_M) // GROUP  # each row's query
        heads = head * GROUP + tl.arange(0, BLOCK_M) % GROUP  # and its q head
    else:
        kv_head = head // GROUP
        offs_m = m_start + tl.arange(0, BLOCK_M)
        heads = tl.full([BLOCK_M], 0, tl.int32) + head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    d_mask = offs_d < HEAD_DIM
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix_len + offs_m

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    table_row_ptr = table_ptr + row * stride_table

    # Keys before this block's first query are visible to every query in it: no causal mask,
    # only the bound of the range (the bulk of the work for a long cached prefix).
    full_end = prefix_len + m_start
    for start in range(0, full_end, BLOCK_N):
        kv_pos = start + offs_n
        kv_mask = kv_pos < full_end
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, kv_pos, kv_mask,
            kv_mask[None, :], offs_d, d_mask, stride_ks, stride_vs, qk_scale, PRECISION,
        )  # fmt: skip
    # The diagonal: keys among this block's own positions, masked causally.
    diag_end = tl.minimum(seq_len, full_end + QUERIES)
    for start in range(full_end, diag_end, BLOCK_N):
        kv_pos = start + offs_n
        kv_mask = kv_pos < diag_end
        causal = kv_mask[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, kv_pos, kv_mask,
            causal, offs_d, d_mask, stride_ks, stride_vs, qk_scale, PRECISION,
        )  # fmt: skip

    # Every real query sees at least its own key, so l > 0 on rows that are stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = o_ptr + (q_start + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


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
    qk_scale,
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
    PDL: tl.constexpr,
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
    # Each request divides its own length over the splits, in whole blocks; a short request leaves
    # trailing splits empty, and they only write (lse = -inf, o = 0), which the reduce ignores.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    table_row_ptr = table_ptr + row * stride_table
    for block_start in range(start, end, BLOCK_N):
        kv_pos = block_start + offs_n
        kv_mask = kv_pos < end
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, kv_pos, kv_mask,
            kv_mask[None, :], offs_d, d_mask, stride_ks, stride_vs, qk_scale, PRECISION,
        )  # fmt: skip

    # Store the normalized partial output and its base-2 log-sum-exp (-inf for an empty split).
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:  # seq_len 0 (a padded graph entry) gives 0, as stage 2 would
        o_ptrs = o_ptr + req.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
        return
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    mo_ptrs = mid_o_ptr + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
    tl.store(mo_ptrs, out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + req * stride_mlb + heads * stride_mlh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
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
    # seq_len 0 (a padded graph entry) empties every split: output 0 rather than NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    mo_ptrs = mid_o_ptr + req * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :]
    parts = tl.load(mo_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + req * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def is_interpreted() -> bool:
    """True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_extend_kernel).__name__ == "InterpretedFunction"


# The interpreter's tl.dot is a slow generic numpy matmul, so its cost is the padded block volume:
# minimal blocks keep CPU tests fast. On the GPU the sizes below are picked for tensor cores.
_SMALL_BLOCKS = is_interpreted()


class _ExtendConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: bool = False


# Longest sequence (cached prefix + extend) up to which the extend kernel takes the short-sequence launch.
_SHORT_EXTEND_SEQ = 2048


def _extend_config(dtype: torch.dtype, head_dim: int, group: int = 1, max_seq_len: int | None = None) -> _ExtendConfig:
    """Launch shape of the extend kernel, from H200 sweeps (`sweep_decode_attention.py --extend`).

    The first sweep (bf16, Hq 32/Hkv 8 D 128 and Hq 9/Hkv 3 D 64; one 4k prompt, 4 x 1k chunks on
    3k prefixes, 16 x 256 prompts) found 64x64 tiles, 4 warps and 3 stages best or within 5%
    everywhere (~295 TFLOP/s at D 128, ~190 at D 64). The second (Hq 16/Hkv 8 D 128, Qwen3-0.6B)
    added packing a KV head's two q heads into one tile's rows: on 16k-token chunks of fresh
    prompts of 100-1024 tokens, 64x32 packed tiles run 215 / 192 / 208 us against 252 / 232 / 247
    for 64x64; on 1k-2k chunks behind 3k-6k prefixes 128x64 packed (4 warps) runs 373 / 385 us
    against 410 / 395 (and 64x32 loses there: 433 / 498). `max_seq_len` (host lengths; None: long)
    picks between the two for D 128 and group 2, the measured case."""
    if _SMALL_BLOCKS:
        return _ExtendConfig(16, 16, 1, 1)
    if dtype == torch.float32:
        # fp32 tiles spill registers at 64x64 with D 128 (25x slower); fp32 is a reference dtype.
        return _ExtendConfig(64, 64, 8, 2) if head_dim <= 64 else _ExtendConfig(32, 32, 4, 2)
    if head_dim == 128 and group == 2:
        short = max_seq_len is not None and max_seq_len <= _SHORT_EXTEND_SEQ
        return _ExtendConfig(64, 32, 4, 3, True) if short else _ExtendConfig(128, 64, 4, 3, True)
    return _ExtendConfig(64, 64 if head_dim <= 128 else 32, 4, 3)


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; other head dims are padded and masked.
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    # fp32 caches are the accuracy reference: keep fp32 dots exact instead of tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    assert q.dim() == 3 and k_cache.dim() == 3 and v_cache.shape == k_cache.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    assert k_cache.shape[2] == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    return num_heads, num_kv_heads, head_dim


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
    *,
    max_extend_len: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    last_blocks_first: bool = True,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack: bool | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over the paged cache [slots, Hkv, D].

    `max_extend_len` (from the host-side lengths) sizes the grid; block sizes are overridable so
    tests can cross block boundaries with small shapes. `last_blocks_first=False` launches the
    query blocks in position order instead, and `num_warps`/`num_stages`/`pack` override the tuned
    launch (sweeps). `max_seq_len` (host-side: the longest prefix + extend) picks the launch.
    """
    num_heads, num_kv_heads, head_dim = _check_layout(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    batch_size = rows.shape[0]
    if batch_size == 0 or max_extend_len == 0:
        return out
    group = num_heads // num_kv_heads
    config = _extend_config(q.dtype, head_dim, group, max_seq_len)
    block_m = block_m or config.block_m
    block_n = block_n or config.block_n
    pack = config.pack if pack is None else pack
    packable = group & (group - 1) == 0 and block_m % group == 0
    assert not pack or packable, f"cannot pack a group of {group} q heads in {block_m} rows"
    if pack:
        grid = (batch_size, num_kv_heads, triton.cdiv(max_extend_len, block_m // group))
    else:
        grid = (batch_size, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out,
        token_table, rows, seq_lens, extend_lens, extend_starts,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), token_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        LAST_BLOCKS_FIRST=last_blocks_first,
        PACK=pack,
        num_warps=num_warps or config.num_warps,
        num_stages=num_stages or config.num_stages,
        **pdl_args(q.device),
    )  # fmt: skip
    return out


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


# Launches measured per captured batch size, where one beat `decode_num_splits` + the defaults:
# H200 (132 SMs), 8 KV heads of D 128 with 2 q heads each (Qwen3-0.6B), bf16. Each was timed on the
# offline workload's batch at the last step the size serves, padded as a replay pads it
# (`sweep_decode_attention.py --graphs`, BENCHMARKS.md ninth session), us per call, default -> this:
GRAPH_TUNED: dict[tuple[int, int, int, int], dict[int, DecodeLaunch]] = {
    # (SMs, KV heads, q heads, head_dim): {captured batch size: launch}
    (132, 8, 16, 128): {
        1: DecodeLaunch(32, 32, 2, 3),  # 8.9 -> 7.3: 64 splits of a ~2k context leave half empty
        2: DecodeLaunch(32, 64, 2, 2),  # 11.6 -> 9.2
        4: DecodeLaunch(16, 64, 2, 2),  # 13.5 -> 11.2
        8: DecodeLaunch(16, 32, 2, 2),  # 20.1 -> 18.2
        32: DecodeLaunch(8, 64, 4, 2),  # 58.2 -> 56.6
        80: DecodeLaunch(2, 64, 2, 2),  # 108.0 -> 106.9
        96: DecodeLaunch(1, 64, 4, 3),  # 117.7 -> 116.4
        112: DecodeLaunch(1, 64, 4, 2),  # 124.7 -> 123.0
        176: DecodeLaunch(1, 32, 2, 3),  # 159.1 -> 152.4
        192: DecodeLaunch(1, 32, 2, 3),  # 161.1 -> 156.9
    },
}


def decode_graph_launch(
    batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, device: torch.device
) -> DecodeLaunch:
    """The launch a CUDA graph captures for `batch_size` requests: the measured one where
    `GRAPH_TUNED` has this GPU, shape and size and the KV cache is 16-bit, as measured
    (MINISGL_DECODE_TUNED=0 ignores the table), else the heuristic split count for a long context
    with the default launch."""
    if ENV.decode_tuned and device.type == "cuda" and kv_dtype.itemsize == 2:
        tuned = GRAPH_TUNED.get((num_sms(device), num_kv_heads, num_heads, head_dim), {}).get(batch_size)
        if tuned is not None:
            return tuned
    return DecodeLaunch(decode_num_splits(batch_size, num_kv_heads, head_dim, None, device))


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
) -> torch.Tensor:
    """One query token per request, q [B, Hq, D], attending to all `seq_lens[b]` cached positions.

    `num_splits` is a launch constant (no data-dependent grid, so CUDA graphs can capture it).
    `mid_o`/`mid_lse` may be larger than needed (static graph buffers): only [:B, :, :num_splits]
    is touched. `order` [B] int32, a permutation of the requests, is the order their programs
    start in (longest first pays: see the kernel). `block_n`/`num_warps`/`num_stages` override the
    tuned launch (sweeps).
    """
    num_heads, num_kv_heads, head_dim = _check_layout(q, k_cache, v_cache)
    assert 1 <= num_splits
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
    _decode_split_kernel[(num_kv_heads, batch_size, num_splits)](
        q, k_cache, v_cache, mid_o, mid_lse, out,
        token_table, rows, seq_lens, order if order is not None else rows,
        sm_scale * _LOG2E,
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
        # H200 sweep of uniform lengths: 2 warps best or tied from batch 1 to 256 (4 warps up to 10%
        # slower at D 64, 8 warps up to 60% slower); wider heads get 4 to keep tiles in registers.
        num_warps=num_warps or (2 if head_dim <= 128 else 4),
        # H200, the offline workload's own decode batches (`sweep_decode_attention.py --workload`):
        # at one split, 2 stages (64 KB of shared memory, 3 programs per SM instead of 2) read
        # 4.2 TB/s where 3 stages read 4.0 (155-218 requests); with several splits 3 stages tie.
        num_stages=num_stages or (2 if num_splits == 1 else 3),
        **pdl_args(q.device),
    )  # fmt: skip
    if num_splits == 1:
        return out
    _decode_reduce_kernel[(batch_size, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_POW2=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=4 if head_dim >= 128 else 2,
        **pdl_args(q.device),
    )  # fmt: skip
    return out


__all__ = [
    "MAX_DECODE_SPLITS",
    "alloc_decode_buffers",
    "DecodeLaunch",
    "decode_attention",
    "decode_graph_launch",
    "decode_num_splits",
    "extend_attention",
    "is_interpreted",
]
