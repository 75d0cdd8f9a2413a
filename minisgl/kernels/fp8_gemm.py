"""FP8 W8A8 GEMM in Triton: `out = x @ W.T` with float8 e4m3 weights and activations.

Two kernels per linear layer: `fp8_quantize` turns the activations into float8 with one scale
per token (or per token and K-group), then `fp8_gemm` multiplies float8 tiles on the tensor cores
(fp32 accumulation) and applies the scales:

- per-channel weights (`group` None): one scale per token times one per output row, applied
  once to the finished fp32 tile;
- grouped (`group` = the block width, 128 for the 128x128 block checkpoints): BLOCK_K is the
  group, and each K step's partial product is scaled by that group's token and row scales
  before it is added (DeepSeek-V3's recipe; the weight's block scales are held one per row).

The layouts and the oracle are kernels/fp8_ref.py's; the result equals `fp8_linear_ref` up to
fp32 summation order where the output is fp32, on sm90 too: each float8 WGMMA's partial sum is
promoted to the fp32 accumulator (`PROMOTE_EVERY`), not left in the tensor core's ~14-bit one for
the K loop. Where the output is 16-bit (the served models), the grouped kernel promotes once per
128-group instead (`promote_for`; DeepSeek-V3's interval): 1.3-1.8e-4 of the output's range off
the float64 product on an H200, 20x under a bf16 half-ulp, and 3.6x faster at 256 rows; and the
per-channel layers beyond 16 rows go to cuBLASLt's float8 GEMM with row-wise scales
(`torch._scaled_mm`, sm90+), 1.3-2x faster than this kernel there, and so do grouped layers
whose scales are true 128x128 blocks (block-scaled cuBLAS, 2.3-2.6x faster than the grouped kernel). The launches are measured
(`gemm_config`, tools/sweep_fp8_gemm.py). Not yet done: the activation quantization fused into
the kernel before (RMSNorm, SiLU), and a float8 MoE kernel
(experts dequantize: layers/fp8.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, MIN_SCALE

# Products a Hopper (sm90) float8 WGMMA may sum in its own accumulator before the partial sum is
# added to the fp32 one: 32, one instruction's K. The accumulator of a float8 WGMMA keeps about
# 14 mantissa bits, and Triton's sm90 default (2^30) chains every K step of a `tl.dot` in it: the
# per-channel path summed its whole K there, the grouped one each 128-group (the H200 test's
# failures at 100 and 1000 rows, BLOCK_M 128: WGMMA; the 16-row tiles use mma.sync). At 32 each
# instruction's partial sum is promoted to fp32. No effect on sm89 or under the interpreter.
PROMOTE_EVERY = 32


def promote_for(group: int | None, out_dtype: torch.dtype) -> int | None:
    """The promotion interval of a launch: every WGMMA (PROMOTE_EVERY) for an fp32 output or a
    per-channel one (one accumulator over all of K: 4-8e-3 of the range off without); per group
    (None: Triton's chaining within one `tl.dot` of BLOCK_K = group) for a 16-bit grouped output."""
    return None if group is not None and out_dtype != torch.float32 else PROMOTE_EVERY


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value (ties to even) in fp32 arithmetic: adding
    and subtracting 2^(e + 20) leaves multiples of the e4m3 step 2^(e - 3) at v's exponent e
    (2^-9 among the subnormals). For the interpreter, whose fp32 -> float8 cast carries a
    rounded-up mantissa into the wrong exponent (x / s just below 2^k gives 2^(k - 1)); the cast of
    the rounded value is then exact."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 147) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # v's sign, -0 too


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, stride_sg,
                     SPAN: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr,
                     ROUND_FIRST: tl.constexpr):  # fmt: skip
    """Program (row, g): columns [g * SPAN, (g + 1) * SPAN) of one row (SPAN = K: the whole row)."""
    row = tl.program_id(0)
    start = tl.program_id(1) * SPAN
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, SPAN, BLOCK):
        cols = start + k0 + offs
        mask = (cols < K) & (k0 + offs < SPAN)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FMAX), SMIN)
    tl.store(s_ptr + row * stride_s + tl.program_id(1) * stride_sg, scale)
    for k0 in range(0, SPAN, BLOCK):
        cols = start + k0 + offs
        mask = (cols < K) & (k0 + offs < SPAN)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
        if ROUND_FIRST:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    b_cols = b_ptr + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_rows + ks[None, :], mask=mask_m[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=mask_n[None, :] & (ks[:, None] < K), other=0.0)
        if GROUPED:
            g = k0 // BLOCK_K
            sa = tl.load(as_ptr + offs_m * stride_asm + g, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptr + offs_n * stride_bsn + g, mask=mask_n, other=0.0)
            acc += tl.dot(a, b, max_num_imprecise_acc=IMPRECISE_ACC) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
    if not GROUPED:
        sa = tl.load(as_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def supported(device: torch.device) -> bool:
    """float8 tensor-core dots: sm89 (Ada) and later; the CPU interpreter (tests) too."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, grouped: bool = False) -> Fp8GemmConfig:
    """The launch for `m` rows of `n` outputs (BLOCK_K is 128, or the group), from
    tools/sweep_fp8_gemm.py on an H200 (2026-12-02, Qwen3-8B's projections; docs/performance.md,
    "FP8 GEMM launches"): decode rows take 16-row tiles with deep pipelines and 32 columns (64 for
    qkv per channel and gate_up grouped; narrower tiles that give every SM two programs measured
    slower); 17-64 rows 64x64 (32x64 grouped over narrow layers); beyond, the grouped kernel 64x128
    with 4 warps, the per-channel one 128x128 with 8 (where the output is 16-bit, `fp8_linear`
    gives the per-channel layers beyond 16 rows to cuBLAS instead)."""
    if m <= 16:
        wide = n >= 16384  # gate_up
        block_n = 64 if (wide if grouped else 4096 < n < 16384) else 32
        return Fp8GemmConfig(16, block_n, 4, 4 if wide else 6)
    if m <= 64:
        return Fp8GemmConfig(32 if grouped and n <= 4096 else 64, 64, 4, 4)
    return Fp8GemmConfig(64, 128, 4, 3) if grouped else Fp8GemmConfig(128, 128, 8, 3)


def fp8_quantize(x: torch.Tensor, group: int | None = None, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_ref.quantize_fp8` of x [M, K] in one launch; `column_major`: the scales [M, G] laid
    out G-major (stride (1, M)), as cuBLAS's block-scaled GEMM reads them."""
    assert x.dim() == 2 and x.stride(-1) == 1, x.shape
    m, k = x.shape
    span = k if group is None else group
    groups = -(-k // span)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(groups, m, dtype=torch.float32, device=x.device).t() if column_major else \
        torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(span), 1024)
        _quantize_kernel[(m, groups)](x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
                                      SPAN=span, BLOCK=block, FMAX=FP8_MAX, SMIN=MIN_SCALE,
                                      ROUND_FIRST=x.device.type == "cpu")  # CPU tensors: the interpreter  # fmt: skip
    return q, scale


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group: int | None,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None,
             promote_every: int | None | str = "auto") -> torch.Tensor:  # fmt: skip
    """xq [M, K] float8 with scales xs [M, G] times qweight [N, K] float8 with scales [N, G]
    (G = 1 per channel, else ceil(K / group)): [M, N] in `out_dtype`. `config` (default
    `gemm_config`) and `promote_every` (default `promote_for`; None: Triton's chaining) are for
    tools/sweep_fp8_gemm.py."""
    m, k = xq.shape
    n = qweight.shape[0]
    assert qweight.shape[1] == k and qweight.stride(1) == 1 and xq.stride(1) == 1
    assert scale.shape[0] == n and xs.shape[0] == m and scale.shape[1] == xs.shape[1], (scale.shape, xs.shape)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = config or gemm_config(m, n, group is not None)
    block_k = 128 if group is None else group
    if promote_every == "auto":
        promote_every = promote_for(group, out_dtype)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _fp8_gemm_kernel[grid](
        xq, xs, qweight, scale, out, bias if bias is not None else out, m, n, k,
        xq.stride(0), qweight.stride(0), out.stride(0), xs.stride(0), scale.stride(0),
        GROUPED=group is not None, HAS_BIAS=bias is not None, IMPRECISE_ACC=None if promote_every is None else min(promote_every, block_k),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group: int | None,
               bias: torch.Tensor | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`fp8_ref.fp8_linear_ref` through the kernels: x [..., K] -> [..., N] in x's dtype. Beyond 16
    bf16 rows on sm90+ cuBLASLt multiplies (`torch._scaled_mm`): per channel with row-wise scales,
    grouped with 1x128 x 128x128 block scales where the layer has `blocks` ([N / 128, K / 128],
    the weight's block scales: `block_scales`) and the rows are a multiple of 8 (the H200 test
    passed at 256 and 1000 rows and failed at 17: decode graphs pad to such sizes, a prefill of
    another size takes the Triton kernel); else the Triton kernel."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    (m, k), n = rows.shape, qweight.shape[0]
    cublas = m > 16 and x.dtype == torch.bfloat16 and k % 128 == 0 and n % 128 == 0 and sm90_cublas(x.device)
    if cublas and group is None:
        xq, xs = fp8_quantize(rows)
        out = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=scale.t(), out_dtype=x.dtype)
    elif cublas and group == 128 and blocks is not None and m % 8 == 0:  # 17 rows: wrong sums on the H200
        xq, xs = fp8_quantize(rows, group, column_major=True)
        out = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=blocks.t(), out_dtype=x.dtype)
    else:
        xq, xs = fp8_quantize(rows, group)
        return fp8_gemm(xq, xs, qweight, scale, group, x.dtype, bias).reshape(*shape[:-1], n)
    if bias is not None:
        out += bias
    return out.reshape(*shape[:-1], n)


def block_scales(scale: torch.Tensor, group: int | None) -> torch.Tensor | None:
    """A grouped layer's per-row scales [N, K / 128] as the 128x128 block scales they repeat
    ([N / 128, K / 128], contiguous), or None where they do not (rows of one block with different
    scales: fused parts or shards not on 128-row boundaries, per-channel or other groups)."""
    n = scale.shape[0]
    if group != 128 or n % 128:
        return None
    blocks = scale[::128].contiguous()
    return blocks if torch.equal(blocks.repeat_interleave(128, dim=0), scale) else None


def sm90_cublas(device: torch.device) -> bool:
    """cuBLASLt's float8 GEMM with row-wise or block scales and a bf16 output: torch's
    `_scaled_mm` on sm90+ (not on Ada, nor under the interpreter)."""
    return device.type == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (9, 0)
