"""The three published 4-bit checkpoint layouts, each converted into the kernels' `W4Weight`
(kernels/w4_ref.py: GPTQ's packing along the input dimension, zero points as uint8).

For a linear layer of K inputs and N outputs, group size g (G = ceil(K / g) groups):
- GPTQ (auto-gptq, GPTQModel): `qweight` int32 [K/8, N], nibble j of row r = input 8r + j;
  `qzeros` int32 [G, N/8], nibble j of column c = output 8c + j, stored as zero - 1 in the v1
  format (`checkpoint_format: gptq`; a stored 15 then reads as 16) and as is in v2;
  `scales` [G, N]; `g_idx` int32 [K], each input's group (act-order: not k // g).
- AWQ (AutoAWQ GEMM): `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], packed along the
  outputs in AWQ's interleaved order: nibble i of a word holds output 8c + AWQ_ORDER[i];
  `scales` [G, N]. Asymmetric, zero points stored as they are.
- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, ceil(K/8)], nibble j of word c =
  input 8c + j, holding the signed value + 8; `weight_scale` [N, G]; `weight_shape` [2] = (N, K);
  asymmetric only: `weight_zero_point` int32 [ceil(N/8), G], the signed zero points + 8 packed
  along the outputs (dim 0). Symmetric zero points are 0 (stored 8).
Every format computes weight = (q - zero) * scale.
"""

from __future__ import annotations

import torch

from minisgl.kernels.w4_ref import PACK, W4Weight, pack_rows
from minisgl.models.quant_config_w4 import W4Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i <- output AWQ_ORDER[i]
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * 4

# Each format's tensors of one quantized linear layer, by suffix.
TENSOR_NAMES: dict[str, tuple[str, ...]] = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "gptq": ("qweight", "qzeros", "scales"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
}


def unpack_columns(packed: torch.Tensor, n: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, ceil(N/8)] packed along the columns -> int32 [R, N] in 0..15; `order`: nibble i
    holds column AWQ_ORDER[i] of its eight."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [R, C, 8], by nibble
    if order is not None:
        columns = torch.empty_like(nibbles)
        columns[..., list(order)] = nibbles
        nibbles = columns
    return nibbles.reshape(packed.shape[0], -1)[:, :n]


def to_w4(scheme: W4Scheme, tensors: dict[str, torch.Tensor], name: str) -> W4Weight:
    """One layer's checkpoint tensors (by suffix) in `scheme`'s layout -> `W4Weight`."""
    missing = [key for key in REQUIRED[scheme.format] if key not in tensors]
    if missing:
        raise ValueError(f"{name}: the {scheme.format} checkpoint lacks {', '.join(missing)}")
    if not scheme.sym and scheme.format == "compressed-tensors" and "weight_zero_point" not in tensors:
        raise ValueError(f"{name}: asymmetric pack-quantized weights without weight_zero_point")
    if scheme.format == "gptq":
        return _gptq(scheme, tensors, name)
    if scheme.format == "awq":
        return _awq(scheme, tensors, name)
    return _compressed(scheme, tensors, name)


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def _group_size(scheme: W4Scheme, k: int) -> int:
    return scheme.group_size if scheme.group_size is not None else k


def _int32(tensor: torch.Tensor, name: str, what: str) -> torch.Tensor:
    _check(tensor.dtype == torch.int32, name, f"{what} must be int32, got {tensor.dtype}")
    return tensor


def _gptq(scheme: W4Scheme, t: dict[str, torch.Tensor], name: str) -> W4Weight:
    qweight = _int32(t["qweight"], name, "qweight")
    scales = t["scales"]
    n = qweight.shape[1]
    k = qweight.shape[0] * PACK
    g = _group_size(scheme, k)
    groups = -(-k // g)
    _check(scales.shape == (groups, n), name, f"scales {tuple(scales.shape)}, expected {(groups, n)} for K={k}, N={n}")
    qzeros = _int32(t["qzeros"], name, "qzeros")
    _check(qzeros.shape == (groups, -(-n // PACK)), name, f"qzeros {tuple(qzeros.shape)} for {groups} groups, N={n}")
    zeros = unpack_columns(qzeros, n) + scheme.zero_offset
    g_idx = t.get("g_idx")
    if g_idx is not None:
        _check(g_idx.shape == (k,), name, f"g_idx {tuple(g_idx.shape)}, expected ({k},)")
        g_idx = g_idx.to(torch.int32)
        _check(bool(((g_idx >= 0) & (g_idx < groups)).all()), name, f"g_idx out of 0..{groups - 1}")
        if not scheme.desc_act and torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // g):
            g_idx = None  # the trivial order: the kernel computes it
    elif scheme.desc_act:
        raise ValueError(f"{name}: desc_act checkpoint without g_idx")
    return W4Weight(qweight.contiguous(), scales.contiguous(), zeros.to(torch.uint8), g_idx, g, k)


def _awq(scheme: W4Scheme, t: dict[str, torch.Tensor], name: str) -> W4Weight:
    qweight = _int32(t["qweight"], name, "qweight")
    scales = t["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    g = _group_size(scheme, k)
    groups = -(-k // g)
    _check(k % g == 0, name, f"AWQ needs the input size {k} to be a multiple of the group size {g}")
    _check(scales.shape == (groups, n), name, f"scales {tuple(scales.shape)}, expected {(groups, n)} for K={k}, N={n}")
    qzeros = _int32(t["qzeros"], name, "qzeros")
    _check(qzeros.shape == (groups, n // PACK), name, f"qzeros {tuple(qzeros.shape)} for {groups} groups, N={n}")
    values = unpack_columns(qweight, n, AWQ_ORDER)  # [K, N]
    zeros = unpack_columns(qzeros, n, AWQ_ORDER)
    return W4Weight(pack_rows(values), scales.contiguous(), zeros.to(torch.uint8), None, g, k)


def _compressed(scheme: W4Scheme, t: dict[str, torch.Tensor], name: str) -> W4Weight:
    packed = _int32(t["weight_packed"], name, "weight_packed")
    shape = [int(v) for v in t["weight_shape"].flatten().tolist()]
    _check(len(shape) == 2, name, f"weight_shape {shape}, expected (out, in)")
    n, k = shape
    _check(packed.shape == (n, -(-k // PACK)), name, f"weight_packed {tuple(packed.shape)} for weight_shape {shape}")
    g = _group_size(scheme, k)
    groups = -(-k // g)
    _check(k % g == 0, name, f"pack-quantized needs the input size {k} to be a multiple of the group size {g}")
    scale = t["weight_scale"]
    _check(scale.shape == (n, groups), name, f"weight_scale {tuple(scale.shape)}, expected {(n, groups)}")
    values = unpack_columns(packed, k)  # [N, K], signed value + 8
    if "weight_zero_point" in t and not scheme.sym:
        zp = _int32(t["weight_zero_point"], name, "weight_zero_point")
        _check(zp.shape == (-(-n // PACK), groups), name, f"weight_zero_point {tuple(zp.shape)} for N={n}, {groups} groups")
        zeros = unpack_columns(zp.t(), n).t()  # [N, G], signed zero + 8
    else:
        zeros = torch.full((n, groups), 8, dtype=torch.int32)
    return W4Weight(pack_rows(values.t()), scale.t().contiguous(), zeros.t().contiguous().to(torch.uint8), None, g, k)
