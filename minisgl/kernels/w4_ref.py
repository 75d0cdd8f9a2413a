"""4-bit weights with group scales and zero points (W4A16): the one packed form the kernels take,
and its plain-torch reference (unpack, dequantize, matmul).

Every checkpoint layout (AWQ, GPTQ, compressed-tensors: models/w4_formats.py) is converted at load
into `W4Weight`, which is GPTQ's packing: `qweight` int32 [ceil(K/8), N], where bits 4j..4j+3 of
row r hold the weight of input k = 8r + j for every output column. Input k belongs to group
`g_idx[k]` (act-order checkpoints) or `k // group_size`; its weight is (q - zeros[g]) * scales[g].
The integers stay packed: 4 bits a weight plus one scale and one zero point a group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACK = 8  # nibbles in an int32
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * 4


@dataclass(frozen=True)
class W4Weight:
    qweight: torch.Tensor  # int32 [ceil(K/8), N]
    scales: torch.Tensor  # float [G, N]
    zeros: torch.Tensor  # uint8 [G, N], in 0..16 (GPTQ v1's stored 15 reads as 16)
    g_idx: torch.Tensor | None  # int32 [K]; None: input k is in group k // group_size
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        rows, n = self.qweight.shape
        assert self.qweight.dtype == torch.int32 and rows == -(-self.in_features // PACK), (self.qweight.shape, self.in_features)
        assert self.scales.shape == self.zeros.shape and self.scales.shape[1] == n, (self.scales.shape, self.zeros.shape)
        assert self.zeros.dtype == torch.uint8
        if self.g_idx is None:
            assert self.scales.shape[0] == -(-self.in_features // self.group_size), (self.scales.shape, self.group_size)
        else:
            assert self.g_idx.shape == (self.in_features,) and self.g_idx.dtype == torch.int32

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.zeros] + ([self.g_idx] if self.g_idx is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def groups(self) -> torch.Tensor:
        """Each input row's group, int64 [K]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def to(self, device: torch.device, scale_dtype: torch.dtype | None = None) -> W4Weight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        scales = self.scales.to(device, scale_dtype or self.scales.dtype)
        return W4Weight(self.qweight.to(device), scales, self.zeros.to(device), move(self.g_idx),
                        self.group_size, self.in_features)  # fmt: skip


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int values in 0..15, [K, N] -> int32 [ceil(K/8), N] (nibble j of row r: input 8r + j)."""
    k, n = values.shape
    padded = torch.zeros(-(-k // PACK) * PACK, n, dtype=torch.int32, device=values.device)
    padded[:k] = values.to(torch.int32)
    if bool(((padded < 0) | (padded > 15)).any()):
        raise ValueError("4-bit values must lie in 0..15")
    words = padded.view(-1, PACK, n) << _SHIFTS.to(values.device).view(1, PACK, 1)
    return words.sum(dim=1, dtype=torch.int32)  # disjoint bits: the sum is the bitwise or


def unpack_rows(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """`pack_rows` undone: int32 [K, N] in 0..15."""
    shifts = _SHIFTS.to(qweight.device).view(1, PACK, 1)
    nibbles = (qweight.unsqueeze(1) >> shifts) & 0xF
    return nibbles.reshape(-1, qweight.shape[1])[:k]


def dequantize(w: W4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] (as `F.linear` takes it, a transposed view), computed in fp32 as
    (q - zero) * scale and then cast."""
    k, n = w.in_features, w.out_features
    if w.g_idx is not None:
        q = unpack_rows(w.qweight, k).float()
        groups = w.groups()
        return q.sub_(w.zeros[groups].float()).mul_(w.scales.float()[groups]).t().to(dtype)
    # Contiguous groups: broadcast each group's row of scales / zeros over its inputs.
    num_groups = w.scales.shape[0]
    padded = num_groups * w.group_size
    q = unpack_rows(w.qweight, min(padded, w.qweight.shape[0] * PACK)).float()
    if q.shape[0] < padded:
        q = torch.cat([q, q.new_zeros(padded - q.shape[0], n)])
    q = q.view(num_groups, w.group_size, n)
    q.sub_(w.zeros.float().unsqueeze(1)).mul_(w.scales.float().unsqueeze(1))
    return q.view(padded, n)[:k].t().to(dtype)


def w4_linear_ref(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(w).T (+ bias), the dequantized weight in x's dtype."""
    return F.linear(x, dequantize(w, x.dtype), bias)


def concat_outputs(parts: list[W4Weight]) -> list[W4Weight]:
    """Neighbouring parts of one input (q|k|v, gate|up) joined along N where they share the group
    layout (act-order parts with different g_idx stay separate)."""
    merged: list[list[W4Weight]] = []
    for part in parts:
        last = merged[-1][-1] if merged else None
        if last is not None and _same_groups(last, part):
            merged[-1].append(part)
        else:
            merged.append([part])
    out = []
    for run in merged:
        if len(run) == 1:
            out.append(run[0])
            continue
        first = run[0]
        out.append(W4Weight(
            torch.cat([p.qweight for p in run], dim=1), torch.cat([p.scales for p in run], dim=1),
            torch.cat([p.zeros for p in run], dim=1), first.g_idx, first.group_size, first.in_features,
        ))  # fmt: skip
    return out


def _same_groups(a: W4Weight, b: W4Weight) -> bool:
    if a.in_features != b.in_features or a.group_size != b.group_size or a.scales.shape[0] != b.scales.shape[0]:
        return False
    if a.g_idx is None or b.g_idx is None:
        return a.g_idx is None and b.g_idx is None
    return bool(torch.equal(a.g_idx, b.g_idx))
