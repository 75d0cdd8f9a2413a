"""MXFP4 (OCP microscaling FP4) weights as GPT-OSS ships them, dequantized in plain torch.

A checkpoint stores each quantized weight W [..., out, in] as two tensors:
- `*_blocks` uint8 [..., out, in / 32, 16]: 32 E2M1 values per block, two per byte, the element
  at the even index in the low nibble and the odd one in the high nibble;
- `*_scales` uint8 [..., out, in / 32]: one E8M0 scale per block, the power of two 2^(s - 127).
E2M1 is sign, two exponent bits and one mantissa bit: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32  # values per scale
E8M0_BIAS = 127
# E2M1 code -> value (bit 3: sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> W [..., G * 32] in `dtype` (the
    checkpoint's [.., out, in] layout, in last). Exact: every value is a power of two times an E2M1
    value, representable in bf16 unless the scale leaves bf16's exponent range."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exponents = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)
