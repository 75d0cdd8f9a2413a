"""Temperature sampling (and greedy rows) in one pass over the logits: the Gumbel-max trick.

`argmax(logits / T + G)` with G ~ Gumbel(0, 1) i.i.d. per token draws from softmax(logits / T),
so the usual chain (float copy, divide, softmax, exponential noise, divide, argmax: six passes
over a [rows, vocab] fp32 tensor, ~1 ms per step at 256 rows of Qwen3's 152k vocab on an H200)
becomes one read of the logits in their own dtype. Rows with T == 0 are greedy: plain argmax,
first index on ties, as `torch.argmax`. Noise comes from a counter-based hash of (per-call seed,
row, token): murmur3's 32-bit finalizer, a few integer ops per token where Philox (`tl.rand`)
spends ~70 and made the kernel compute-bound (184 us vs the ~20 us the read takes at 256 rows on
an H200). The kernel needs no RNG state and no host reads.

Each row is cut into splits handled by separate programs (enough programs to fill the GPU at
small batch); a second small kernel picks each row's best split, the first among equal maxima,
which keeps the lowest index since splits are in vocab order.

Used for the common case only (no top-k/top-p/min-p, no per-request seed, no logit controls);
everything else takes the general path in `engine/sampler.py`, which is also its reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, libdevice

from minisgl.kernels.pdl import pdl_args

_SPLIT = 8192  # vocab entries per program
_BLOCK = 1024


@triton.jit
def hash_uniform(h):
    """A uniform in (0, 1) from the uint32 key `h`: murmur3's 32-bit finalizer, then 23 of its bits
    put under a float's exponent 0 (v in [1, 2)), with no int -> float convert, which the sampling
    kernel's instruction count feels (31 vs 33 us at 170 rows on an H200)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    v = ((h >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
    return v - 0.999999940395355224609375  # v - (1 - 2^-24), exact: in [2^-24, 1 - 2^-24]


# The seed changes every call: not specialised (Triton would otherwise compile a variant the first
# time a seed is divisible by 16, mid-run).
@triton.jit(do_not_specialize=["seed"])
def _gumbel_argmax_kernel(
    logits_ptr,
    temp_ptr,
    val_ptr,
    idx_ptr,
    stride_row,
    vocab,
    num_splits,
    seed,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temp_ptr + row)
    inv_t = 1.4426950408889634 / tl.maximum(temperature, 1e-20)  # log2(e) / T
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    lanes = tl.arange(0, BLOCK)
    row_key = seed.to(tl.uint32) + row.to(tl.uint32) * 0x85EBCA77
    base = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(split * SPLIT, tl.minimum(split * SPLIT + SPLIT, vocab), BLOCK):
        offs = start + lanes
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            u = hash_uniform(offs.to(tl.uint32) * 0x9E3779B1 + row_key)
            # Scores in log2 units: log2(e) * (x / T + Gumbel) = x * log2(e) / T - log2(-log2(u))
            # plus a constant, so the argmax is the same. On the GPU log2 is the hardware's
            # approximate lg2 (one instruction, ~2^-22 relative error: noise for noise); tl.log2
            # is libdevice's exact one, a dozen FMAs, which made the kernel compute-bound.
            if FAST_LOG:
                gumbel = libdevice.fast_log2f(-libdevice.fast_log2f(u))
            else:
                gumbel = tl.log2(-tl.log2(u))
            x = tl.where(mask, x * inv_t - gumbel, float("-inf"))
        better = x > best_val  # strict: each lane keeps its first maximum
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, axis=0)
    # Lowest index among the lanes holding the maximum (an all -inf split reports its first index).
    first = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(val_ptr + row * num_splits + split, top)
    tl.store(idx_ptr + row * num_splits + split, first)


@triton.jit
def _pick_split_kernel(val_ptr, idx_ptr, out_ptr, num_splits, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Per row: the token of the best split (the first among equal maxima: splits are in vocab
    order), as int64."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS)
    mask = offs < num_splits
    vals = tl.load(val_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    top = tl.max(vals, axis=0)
    first = tl.min(tl.where((vals == top) & mask, offs, SPLITS), axis=0)
    token = tl.load(idx_ptr + row * num_splits + first)
    tl.store(out_ptr + row, token.to(tl.int64))


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seed: int, *, split: int = _SPLIT, block: int = _BLOCK,
    num_warps: int = 4, fast_log: bool | None = None,
) -> torch.Tensor:
    """logits [R, V] (any float dtype, unit stride along V), temperature [R] float32 (0: greedy)
    -> sampled token ids [R] int64. `split`/`block`/`num_warps` override the launch (sweeps)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == (rows,)
    assert rows * vocab < 2**31, "kept within int32 element offsets"
    block = min(block, triton.next_power_of_2(vocab))
    split = max(block, split // block * block)
    num_splits = triton.cdiv(vocab, split)
    values = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_splits, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, num_splits)](
        logits, temperature.float(), values, indices, logits.stride(0), vocab, num_splits, seed & 0x7FFFFFFF,
        SPLIT=split, BLOCK=block, FAST_LOG=logits.is_cuda if fast_log is None else fast_log, num_warps=num_warps,
        **pdl_args(logits.device),
    )  # fmt: skip
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _pick_split_kernel[(rows,)](
        values, indices, tokens, num_splits, SPLITS=triton.next_power_of_2(num_splits), num_warps=1,
        **pdl_args(logits.device),
    )  # fmt: skip
    return tokens
