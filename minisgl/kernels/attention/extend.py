"""Triton paged attention of new tokens (prefill, chunked prefill) over a cached prefix: the
causal extend kernel and its launch, with an optional sliding window, logit soft-cap and
attention sinks."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from minisgl.kernels.attention.common import (
    _SMALL_BLOCKS,
    _attend_block,
    _block_d,
    _bulk_loop,
    _check_layout,
    _precision,
    _score_scales,
)
from minisgl.kernels.pdl import pdl_args


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
    sinks_ptr,
    kv_bases_ptr,
    k_desc,
    v_desc,
    qk_scale,
    cap_scale,
    v_scale,
    window,
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
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    BULK: tl.constexpr,
    KV_LOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Without PACK a program is (request, q head, block of BLOCK_M queries). With PACK it is
    (request, KV head, block of BLOCK_M // GROUP queries), its BLOCK_M rows being every q head of
    the group for each query (row r: query r // GROUP, head r % GROUP of the group), so each K/V
    tile loaded serves all the heads that share it.

    WINDOWED: query at position p sees keys in (p - window, p]; key blocks before the block's
    first query's window are not visited at all.

    SINKS: each q head's learned logit `sinks[head]` joins the softmax denominator (GPT-OSS): the
    running max starts at it and the running sum at its exp2(0) = 1, so it never adds a value.

    BULK (not with WINDOWED): the whole key blocks before the block's first query run with no
    mask at all (`_bulk_loop`); the partial block after them joins the diagonal loop, which
    masks causally. KV_LOAD (with BULK): 0 reads every bulk key through the token
    table; 1 and 2 read a request whose slots are one run (`kv_bases[req]` >= 0, its first slot;
    `contiguous_bases`) at affine addresses (1) or through the TMA descriptors k_desc / v_desc over
    the cache as [slots, Hkv * D] (2), and other requests through the table."""
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
    if SINKS:  # in base 2, as the scores
        m_i = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
        l_i += 1.0
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    table_row_ptr = table_ptr + row * stride_table

    full_end = prefix_len + m_start
    if BULK:
        bulk_end = full_end - full_end % BLOCK_N
        run_base = -1
        if KV_LOAD != 0:
            run_base = tl.load(kv_bases_ptr + req)
        if run_base >= 0:  # a one-run request (never taken with KV_LOAD 0: -1 is a constant then)
            acc, m_i, l_i = _bulk_loop(
                acc, m_i, l_i, q, k_desc, v_desc, k_head_ptr, v_head_ptr, table_row_ptr, run_base, kv_head,
                bulk_end, offs_n, offs_d, d_mask, stride_ks, stride_vs, qk_scale, cap_scale, HEAD_DIM, BLOCK_D,
                BLOCK_N, PRECISION, SOFTCAP, KV_LOAD,
            )  # fmt: skip
        else:
            acc, m_i, l_i = _bulk_loop(
                acc, m_i, l_i, q, k_desc, v_desc, k_head_ptr, v_head_ptr, table_row_ptr, 0, kv_head, bulk_end,
                offs_n, offs_d, d_mask, stride_ks, stride_vs, qk_scale, cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                PRECISION, SOFTCAP, 0,
            )  # fmt: skip
        diag_start = bulk_end
    else:
        # Keys before this block's first query are visible to every query in it: no causal mask,
        # only the bound of the range (the bulk of the work for a long cached prefix).
        # With a window each query also masks the keys it slid past, and the loop starts at the
        # first query's oldest visible key: a long prefix costs at most the window.
        first = 0
        if WINDOWED:
            first = tl.maximum(full_end - window + 1, 0)
        for start in range(first, full_end, BLOCK_N):
            kv_pos = start + offs_n
            kv_mask = kv_pos < full_end
            visible = kv_mask[None, :]
            if WINDOWED:
                visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, kv_pos, kv_mask,
                visible, offs_d, d_mask, stride_ks, stride_vs, qk_scale, cap_scale, PRECISION, SOFTCAP,
            )  # fmt: skip
        diag_start = full_end
    # The diagonal: keys among this block's own positions, masked causally.
    diag_end = tl.minimum(seq_len, full_end + QUERIES)
    for start in range(diag_start, diag_end, BLOCK_N):
        kv_pos = start + offs_n
        kv_mask = kv_pos < diag_end
        causal = kv_mask[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            causal = causal & (kv_pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, kv_pos, kv_mask,
            causal, offs_d, d_mask, stride_ks, stride_vs, qk_scale, cap_scale, PRECISION, SOFTCAP,
        )  # fmt: skip

    # Every real query sees at least its own key, so l > 0 on rows that are stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # v_scale: a float8 cache's
    o_ptrs = o_ptr + (q_start + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])



@triton.jit
def _run_bases_kernel(
    table_ptr, rows_ptr, seq_lens_ptr, bases_ptr, stride_table, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """bases[req]: the slot of position 0 when positions [0, seq_len) sit in slots base + pos, else -1."""
    if PDL:
        gdc_wait()
    req = tl.program_id(0)
    row = tl.load(rows_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    table_row_ptr = table_ptr + row * stride_table
    first = tl.load(table_row_ptr)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, seq_len, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        inside = pos < seq_len
        slots = tl.load(table_row_ptr + pos, mask=inside, other=0)
        bad += (inside & (slots != first + pos)).to(tl.int32)
    tl.store(bases_ptr + req, tl.where(tl.sum(bad, 0) == 0, first, -1))


def contiguous_bases(token_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] int32: each request's first slot where its positions [0, seq_len) are one run of slots
    (slot = first + pos), else -1. One small launch; the extend kernel's KV_LOAD 1 and 2 read it."""
    bases = torch.empty(rows.shape[0], dtype=torch.int32, device=rows.device)
    if rows.shape[0]:
        _run_bases_kernel[(rows.shape[0],)](
            token_table, rows, seq_lens, bases, token_table.stride(0), BLOCK=1024, **pdl_args(rows.device)
        )
    return bases


class _ExtendConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: bool = False
    bulk: bool = False  # whole key blocks before the first query with no mask (not windowed)
    kv_load: str = "gather"  # with bulk, a one-run request's bulk keys: "gather", "run" or "tma"


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
    picks between the two for D 128 and group 2, the measured case.

    The third (fifteenth session, `tools/sweep_extend.py`, one H200 call) made the long launch a
    bulk one (no mask before the diagonal) reading keys through TMA where a request's slots are one
    run: 256x64 packed tiles, 8 warps, 3 stages. Whole 0.6B-shape prefill (bench offline's engine,
    median of 3): 8k 0.0332 s against 0.0434, 32k 0.302 s against 0.422 (16k chunks). Alone,
    128x128 tiles were faster on the kernel (606 TFLOP/s at 32k, 1.68x the old launch) but slower in
    the model (0.380 s at 32k)."""
    if _SMALL_BLOCKS:
        return _ExtendConfig(16, 16, 1, 1)
    if dtype == torch.float32:
        # fp32 tiles spill registers at 64x64 with D 128 (25x slower); fp32 is a reference dtype.
        return _ExtendConfig(64, 64, 8, 2) if head_dim <= 64 else _ExtendConfig(32, 32, 4, 2)
    if head_dim == 128 and group == 2:
        short = max_seq_len is not None and max_seq_len <= _SHORT_EXTEND_SEQ
        return _ExtendConfig(64, 32, 4, 3, True) if short else _ExtendConfig(256, 64, 8, 3, True, True, "tma")
    return _ExtendConfig(64, 64 if head_dim <= 128 else 32, 4, 3)


_KV_LOADS = {"gather": 0, "run": 1, "tma": 2}


def extend_reads_runs(dtype: torch.dtype, head_dim: int, group: int, max_seq_len: int | None) -> bool:
    """Whether the default launch for these sequences reads one-run requests apart ("run" / "tma"),
    so that a caller can compute `contiguous_bases` once for all layers and pass `kv_bases`."""
    config = _extend_config(dtype, head_dim, group, max_seq_len)
    return config.bulk and config.kv_load != "gather"


def _descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, block_d: int) -> tuple[Any, Any]:
    """TMA descriptors of the caches as [slots, Hkv * D], a [block_n, D] box per load; (None,
    None) where the layout does not allow it (a padded head dim, a strided view)."""
    head_dim = k_cache.shape[2]
    if block_d != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None, None
    box = [block_n, head_dim]
    k_desc = TensorDescriptor.from_tensor(k_cache.view(k_cache.shape[0], -1), box)
    return k_desc, TensorDescriptor.from_tensor(v_cache.view(v_cache.shape[0], -1), box)


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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    bulk: bool | None = None,
    kv_load: str | None = None,
    kv_bases: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over the paged cache [slots, Hkv, D].

    `max_extend_len` (from the host-side lengths) sizes the grid; block sizes are overridable so
    tests can cross block boundaries with small shapes. `last_blocks_first=False` launches the
    query blocks in position order instead, and `num_warps`/`num_stages`/`pack` override the tuned
    launch (sweeps). `max_seq_len` (host-side: the longest prefix + extend) picks the launch.
    `window` (a sliding window: each query sees its last `window` positions, itself included) and
    `softcap` (`cap * tanh(scores / cap)` before softmax) select the kernel variant; None: off.
    `sinks` [Hq]: a logit per q head in every softmax's denominator (attention sinks).
    `bulk` / `kv_load` override the launch's way of reading the keys before each query block (the
    kernel's BULK / KV_LOAD: "gather", "run", "tma"); a windowed call never takes bulk from the
    config. `kv_bases` ([B] int32, `contiguous_bases`) saves recomputing them for "run" / "tma".
    """
    num_heads, num_kv_heads, head_dim = _check_layout(q, k_cache, v_cache)
    assert window is None or window > 0, window
    assert sinks is None or sinks.shape == (num_heads,), "sinks: one logit per q head"
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
    if bulk and window is not None:
        raise ValueError("bulk (unmasked key blocks) cannot run a sliding window")
    bulk = (config.bulk and window is None) if bulk is None else bulk
    kv_load = config.kv_load if kv_load is None else kv_load
    if kv_load not in _KV_LOADS:
        raise ValueError(f"kv_load {kv_load!r}: use one of {', '.join(_KV_LOADS)}")
    block_d = _block_d(head_dim)
    load = _KV_LOADS[kv_load] if bulk else 0
    k_desc, v_desc = _descriptors(k_cache, v_cache, block_n, block_d) if load == 2 else (None, None)
    if load == 2 and k_desc is None:
        load = 1  # a cache TMA cannot describe: affine loads instead
    if load and kv_bases is None:
        kv_bases = contiguous_bases(token_table, rows, seq_lens)
    _extend_kernel[grid](
        q, k_cache, v_cache, out,
        token_table, rows, seq_lens, extend_lens, extend_starts, sinks if sinks is not None else q,
        kv_bases if load else rows, k_desc if k_desc is not None else k_cache,
        v_desc if v_desc is not None else v_cache, *_score_scales(sm_scale * k_scale, softcap), v_scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), token_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        LAST_BLOCKS_FIRST=last_blocks_first,
        PACK=pack,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        BULK=bulk,
        KV_LOAD=load,
        num_warps=num_warps or config.num_warps,
        num_stages=num_stages or config.num_stages,
        **pdl_args(q.device),
    )  # fmt: skip
    return out
