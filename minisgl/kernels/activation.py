"""SiLU-and-mul in one launch (eager torch: a chunk, a silu and a mul kernel).

Rounding follows `activation_ref.py` (HF): silu(gate) rounds to the input dtype before the
product with `up`, which rounds again. No host reads: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.norm import row_norm_args, row_rms_scale
from minisgl.kernels.pdl import pdl_args

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    h_ptr,
    stride_ht,
    h_eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + N + cols, mask=mask, other=0.0).to(tl.float32)
    if HIDDEN > 0:  # projected from the un-normalised row h: apply its RMSNorm scale (and round)
        row_scale = row_rms_scale(h_ptr, token, stride_ht, h_eps, HIDDEN, BLOCK_HIDDEN)
        gate = (gate * row_scale).to(dtype).to(tl.float32)
        up = (up * row_scale).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x = [gate | up] along the last dim (unit stride) -> silu(gate) * up, a new contiguous tensor.

    `row_norm` = (hidden [T, H], eps): x was projected from the un-normalised `hidden` with the
    RMSNorm weight folded into the projection; each row of x is first scaled by 1 / rms(hidden)
    (and rounded to x's dtype), which completes that norm."""
    n = x.shape[-1] // 2
    assert x.shape[-1] == 2 * n and x.stride(-1) == 1
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, 2 * n)
    out2 = out.view(-1, n)
    if x2.shape[0] == 0 or n == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, out2, x2.stride(0), out2.stride(0), N=n, BLOCK=block, **row_norm_args(row_norm, x2.shape[0], x2),
        num_warps=max(1, min(4, block // 256)), **pdl_args(x.device),
    )  # fmt: skip
    return out
