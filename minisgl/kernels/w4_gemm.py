"""W4A16 dequant-GEMM: out = x @ dequantize(w).T for a `W4Weight` (kernels/w4_ref.py), x [M, K]
in bf16 / fp16 / fp32.

Each program computes one [BLOCK_M, BLOCK_N] output tile. Along K it loads a [BLOCK_K / 8,
BLOCK_N] slab of packed words (one int32 word per 8 inputs of a column), shifts each input's
nibble out, looks up that input's group (k // group_size, or g_idx[k] for act-order GPTQ) to
gather its scale and zero point, forms (q - zero) * scale in fp32, rounds it to x's dtype (as
the reference's dequantized weight is) and accumulates x-tile @ w-tile in fp32. The weight never
exists in float outside registers. fp32 inputs use IEEE fp32 dot products (no TF32), so the
kernel matches the reference up to summation order; the reference is `w4_linear_ref`. Under the
CPU interpreter (tests) the dot runs on fp32-widened tiles: its bf16 dot is broken, and 16-bit
products are exact in fp32, so that is the same sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.w4_ref import W4Weight


@triton.jit
def _w4_gemm_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, gidx_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, group_size,
    HAS_GIDX: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        mask_w = mask_k[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=mask_w, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_GIDX:
            group = tl.load(gidx_ptr + offs_k, mask=mask_k, other=0)
        else:
            group = offs_k // group_size
        cell = group[:, None] * N + offs_n[None, :]
        scale = tl.load(scale_ptr + cell, mask=mask_w, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + cell, mask=mask_w, other=0).to(tl.int32)
        w = ((q - zero).to(tl.float32) * scale).to(x.dtype)
        if WIDEN:  # the interpreter's 16-bit dot is wrong for bf16; products of 16-bit floats are exact in fp32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        elif IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


_INTERPRETED = type(_w4_gemm_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode rows in one 16-row tile, prefill in 64-row tiles."""
    return (16 if m <= 16 else 64), 64, 64


def w4_gemm(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T (+ bias) -> [..., N] in x's dtype."""
    k, n = w.in_features, w.out_features
    assert x.shape[-1] == k, (x.shape, k)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_m, block_n, block_k = _blocks(m)
    gidx = w.g_idx if w.g_idx is not None else w.qweight  # not read without HAS_GIDX
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4_gemm_kernel[grid](
        x2, w.qweight, w.scales, w.zeros, gidx, out,
        m, n, k, x2.stride(0), out.stride(0), w.group_size,
        HAS_GIDX=w.g_idx is not None, IEEE=x.dtype == torch.float32, WIDEN=_INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    if bias is not None:
        out += bias
    return out.reshape(*lead, n)
