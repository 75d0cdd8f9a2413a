"""RMSNorm in one launch: plain, per head ([T, H, D] views with any strides), or fused with the
residual add that precedes it in every decoder block.

Eager torch spends ~8 kernels per norm (casts, pow, mean, rsqrt, muls, the residual add); in
launch-bound decode those dominate GPU time. The rounding follows `norm_ref.py` (HF): the sum
rounds to the input dtype, the normalised fp32 value is cast to the input dtype, then multiplied
by the weight and rounded to the result dtype, so bf16 output matches HF up to the fp32 reduction
order. No host reads: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.pdl import pdl_args

# Elements one program normalises: several short rows (per-head norms, D = 64..256) share a
# program so prefill does not launch T * H tiny programs; one long row (hidden 4096+) is alone.
_TILE_ELEMS = 2048


# Row counts change with every batch: not specialised, or Triton would compile a variant the first
# time a count is divisible by 16 (or is 1), in the middle of serving.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    inner_rows,
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    stride_oo,
    stride_oi,
    stride_qo,
    stride_qi,
    eps,
    N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    # Rows are (outer, inner) pairs so a [T, H, D] head view of a fused qkv buffer is read in
    # place: its T and H strides do not merge into one row stride.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    outer = (rows // inner_rows).to(tl.int64)
    inner = (rows % inner_rows).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < N)[None, :]
    x_dtype = x_ptr.dtype.element_ty

    x = tl.load(x_ptr + (outer * stride_xo + inner * stride_xi)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        res_offs = (outer * stride_ro + inner * stride_ri)[:, None] + cols[None, :]
        res = tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
        total = (x + res).to(x_dtype)  # the new residual, rounded as `x + residual` is
        res_out_offs = (outer * stride_qo + inner * stride_qi)[:, None] + cols[None, :]
        tl.store(res_out_ptr + res_out_offs, total, mask=mask)
        x = total.to(tl.float32)

    mean_sq = tl.sum(x * x, axis=1) / N
    rstd = tl.math.rsqrt(mean_sq + eps)
    normed = (x * rstd[:, None]).to(x_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = (w[None, :] * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (outer * stride_oo + inner * stride_oi)[:, None] + cols[None, :], out, mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., N] as [outer, inner, N] without copying 2-D and 3-D views (head views of qkv)."""
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    eps: float,
) -> None:
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.stride(0) == 1, "weight must be a contiguous [N] vector"
    x3, out3 = _as_3d(x), _as_3d(out)
    res3 = _as_3d(residual) if residual is not None else x3
    res_out3 = _as_3d(res_out) if res_out is not None else out3
    for t in (x3, out3, res3, res_out3):
        assert t.stride(2) == 1, "the normalised dim must be contiguous"
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0:
        return
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(_TILE_ELEMS // block_n, triton.next_power_of_2(num_rows)))
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x3, res3, weight, out3, res_out3,
        num_rows, x3.shape[1],
        x3.stride(0), x3.stride(1), res3.stride(0), res3.stride(1),
        out3.stride(0), out3.stride(1), res_out3.stride(0), res_out3.stride(1),
        eps,
        N=n, BLOCK_R=block_r, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
        num_warps=max(1, min(8, block_r * block_n // 256)),
        **pdl_args(x.device),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` [..., N] (2-D/3-D views with any outer strides, unit last
    stride); returns a new contiguous tensor of dtype promote(x, weight), as `weight * x` gives."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x, None, weight, out, None, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; with `inplace` the normed rows go into
    `x` and the sum into `residual` (then weight must not widen x's dtype)."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    if inplace:
        assert x.dim() <= 3, "in place needs a 2-D or 3-D view (higher ranks may be reshaped into a copy)"
        assert torch.promote_types(x.dtype, weight.dtype) == x.dtype, "in place needs weight dtype <= x dtype"
        _launch(x, residual, weight, x, residual, eps)
        return x, residual
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, out, new_residual, eps)
    return out, new_residual


# --- Folded norms: kernels after a projection of un-normalised rows apply the norm's scale ---


@triton.jit
def row_rms_scale(h_ptr, row, stride_ht, h_eps, HIDDEN: tl.constexpr, BLOCK_HIDDEN: tl.constexpr):
    """1 / rms of row `row` of h [T, HIDDEN] (fp32, as the RMSNorm computes it): what a kernel
    applies to values projected from the un-normalised row with the norm's weight folded into
    the projection (`models/llama.py: DecoderLayer.forward_folded`)."""
    cols = tl.arange(0, BLOCK_HIDDEN)
    h = tl.load(h_ptr + row * stride_ht + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    return tl.math.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + h_eps)


def row_norm_args(row_norm: tuple[torch.Tensor, float] | None, rows: int, placeholder: torch.Tensor) -> dict:
    """Launch arguments (by name) of a kernel taking `h_ptr, stride_ht, h_eps` and the constexprs
    `HIDDEN, BLOCK_HIDDEN` for `row_rms_scale`: from `row_norm` = (hidden [rows, H], eps), or
    HIDDEN = 0 (no scaling; `placeholder`, never read, stands in for the pointer)."""
    if row_norm is None:
        return {"h_ptr": placeholder, "stride_ht": 0, "h_eps": 0.0, "HIDDEN": 0, "BLOCK_HIDDEN": 1}
    hidden, eps = row_norm
    assert hidden.dim() == 2 and hidden.shape[0] == rows and hidden.stride(1) == 1
    return {"h_ptr": hidden, "stride_ht": hidden.stride(0), "h_eps": eps, "HIDDEN": hidden.shape[1],
            "BLOCK_HIDDEN": triton.next_power_of_2(hidden.shape[1])}  # fmt: skip
