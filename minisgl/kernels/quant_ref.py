"""Plain-torch references for the weight-only quantized CPU kernels (kernels/cpu_quant.py): each GGUF
block type dequantized to fp32 with the same float operations, in the same order, as
`gguf.quants.dequantize` (bit-identical; tests/kernels/test_cpu_quant.py checks it), then an fp32
matmul. Block layouts (ggml-common.h), per block of `QK` weights of `BYTES` bytes:

- Q8_0 (32, 34): fp16 d, int8 q[32]; w = d * q.
- Q4_0 (32, 18): fp16 d, 16 bytes of nibbles (low nibbles are weights 0..15, high 16..31);
  w = d * (q - 8).
- Q4_1 (32, 20): fp16 d, fp16 m, nibbles as Q4_0; w = (d * q) + m.
- Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes packing 8 six-bit scales and mins, 128 bytes of
  nibbles (sub-block j of 32 reads bytes 32*(j//2).., low nibbles for even j);
  w = (d * sc_j) * q - (dmin * m_j).
- Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of 2-bit highs, int8 scales[16] (one per 16
  weights), fp16 d; w = (d * scale) * (q - 32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class QuantType(NamedTuple):
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_size: int  # weights per block
    type_size: int  # bytes per block


QUANT_TYPES: dict[str, QuantType] = {
    q.name: q
    for q in (
        QuantType("Q4_0", 2, 32, 18),
        QuantType("Q4_1", 3, 32, 20),
        QuantType("Q8_0", 8, 32, 34),
        QuantType("Q4_K", 12, 256, 144),
        QuantType("Q6_K", 14, 256, 210),
    )
}


def quant_type(qtype: str | int | QuantType) -> QuantType:
    """The QuantType named by a gguf type name, a GGML type id, or a QuantType itself."""
    if isinstance(qtype, QuantType):
        return qtype
    for q in QUANT_TYPES.values():
        if qtype in (q.name, q.ggml_type) and not isinstance(qtype, bool):
            return q
    raise ValueError(f"unsupported quantized type {qtype!r}; supported: {', '.join(QUANT_TYPES)}")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> [..., 1] fp32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16*k] bytes -> [n, 32*k] uint8: per 16-byte group the low nibbles, then the high ones."""
    q = qs.reshape(qs.shape[0], -1, 1, 16)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], -1)


def _q4k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    q = qs.reshape(qs.shape[0], -1, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def _dequant_blocks(blocks: torch.Tensor, q: QuantType) -> torch.Tensor:
    """[n, type_size] uint8 -> [n, block_size] fp32."""
    n = blocks.shape[0]
    if q.name == "Q8_0":
        return _f16(blocks[:, :2]) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if q.name == "Q4_0":
        return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    if q.name == "Q4_1":
        return (_f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]).float()) + _f16(blocks[:, 2:4])
    if q.name == "Q4_K":
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        s = blocks[:, 4:16].reshape(n, 3, 4)
        lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
        sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1).float()
        mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1).float()
        qv = _q4k_nibbles(blocks[:, 16:]).float()
        return ((d * sc)[..., None] * qv - (dmin * mn)[..., None]).reshape(n, 256)
    if q.name == "Q6_K":
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 4, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2)
        qv = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        ds = _f16(blocks[:, 208:210]) * blocks[:, 192:208].contiguous().view(torch.int8).float()
        return (ds[..., None] * qv).reshape(n, 256)
    raise AssertionError(q)


def row_shape(weight: torch.Tensor, qtype: str | int | QuantType) -> tuple[int, int]:
    """(N, K) of a [N, row_bytes] uint8 tensor of blocks."""
    q = quant_type(qtype)
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"quantized weight must be a 2-D uint8 tensor of blocks, got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[1] % q.type_size:
        raise ValueError(f"{q.name} row of {weight.shape[1]} bytes is not a whole number of {q.type_size}-byte blocks")
    return weight.shape[0], weight.shape[1] // q.type_size * q.block_size


def dequantize_ref(weight: torch.Tensor, qtype: str | int | QuantType) -> torch.Tensor:
    """[N, row_bytes] uint8 blocks -> [N, K] fp32, equal to gguf.quants.dequantize bit for bit."""
    q = quant_type(qtype)
    n, k = row_shape(weight, q)
    blocks = weight.reshape(-1, q.type_size)
    return _dequant_blocks(blocks, q).reshape(n, k)


def quant_matmul_ref(x: torch.Tensor, weight: torch.Tensor, qtype: str | int | QuantType) -> torch.Tensor:
    """y = x @ W^T with W the fp32 dequantized weights; x [..., K] fp32 -> [..., N]."""
    return x @ dequantize_ref(weight, qtype).T
