"""FP8 (float8 e4m3) W8A8 linear layers in plain torch: the reference and the test oracle of
kernels/fp8_gemm.py.

One weight layout serves every checkpoint format (layers/fp8.py converts them): `qweight`
[N, K] float8_e4m3fn and fp32 `scale`, either [N, 1] (one per output row: per-channel, or a
per-tensor scale repeated) or [N, ceil(K / group)] (one per row and K-group: a block format's
[N / 128, K / 128] scales repeated over each block's rows, so fused and sharded layers slice
rows freely). Activations are quantized at run time to the same granularity: one scale per
token, or per token and K-group. Every scale multiplies: value = float8 * scale.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# Floor of a scale, so that an all-zero row quantizes to zeros instead of 0 / 0.
MIN_SCALE = 1e-12


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax / 448, floored at MIN_SCALE, correctly rounded on every device (the kernel's
    `div_rn`). Divided by a tensor on purpose: CUDA torch divides by a Python scalar as a multiply
    by its fp32 reciprocal, 1 ulp off for some amax (the GPU test saw it)."""
    return torch.div(amax, torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)


def _groups(k: int, group: int | None) -> int:
    return 1 if group is None else -(-k // group)


def _grouped(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, int]:
    """x [..., K] as [..., G, group] (zero-padded), and the padding."""
    if group is None:
        return x.unsqueeze(-2), 0
    pad = (-x.shape[-1]) % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (x.shape[-1] // group, group)), pad


def quantize_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric float8 of the rows of x [M, K]: (q [M, K] float8_e4m3fn, scale [M, G] fp32) with
    G = 1 (group None) or ceil(K / group); scale = amax / 448 of each row (group), q = x / scale
    rounded to nearest, saturated at +-448."""
    xs, pad = _grouped(x.float(), group)
    scale = amax_scale(xs.abs().amax(dim=-1))
    q = (xs / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.flatten(-2)
    return (q[..., : q.shape[-1] - pad] if pad else q), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """fp32 values of `quantize_fp8`'s output (scale [M, 1] or [M, ceil(K / group)])."""
    k = q.shape[-1]
    assert scale.shape[-1] == _groups(k, group) or (group is None and scale.shape[-1] == 1), (scale.shape, k, group)
    if group is None:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., :k]


def fp8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group: int | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ W.T with W = dequantize(qweight, scale): x quantized per token (per token and
    `group`), both sides dequantized and multiplied in fp32; the output in x's dtype."""
    shape = x.shape
    xq, xs = quantize_fp8(x.reshape(-1, shape[-1]), group)
    out = dequantize_fp8(xq, xs, group) @ dequantize_fp8(qweight, scale, group).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])


def block_scales_to_rows(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """A block format's [ceil(N / block_rows), G] scales as one row per weight row, [rows, G]."""
    return scale.float().repeat_interleave(block_rows, dim=0)[:rows]


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [N, K] weight in the 128x128 block format (as the checkpoints ship it): (float8
    [N, K], scales [ceil(N / rows), ceil(K / cols)], amax / 448 of each block). For the tests'
    checkpoints and the MoE experts quantized at load."""
    rows, cols = block
    n, k = weight.shape[-2:]
    pad_n, pad_k = (-n) % rows, (-k) % cols
    w = torch.nn.functional.pad(weight.float(), (0, pad_k, 0, pad_n))
    tiles = w.unflatten(-1, (w.shape[-1] // cols, cols)).unflatten(-3, (w.shape[-2] // rows, rows))
    scale = amax_scale(tiles.abs().amax(dim=(-3, -1)))  # [..., N/rows, K/cols]
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.flatten(-2).flatten(-3, -2)
    return q[..., :n, :k].contiguous(), scale
