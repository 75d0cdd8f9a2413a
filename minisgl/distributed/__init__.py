"""Tensor-parallel group of this process: set once at start-up, like the platform.

Importing this package does not import torch (the launcher checks layouts with `layout.py` and
hosts the rendezvous store without paying for it); the collectives import it when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP = TPInfo()


def set_tp_info(info: TPInfo) -> None:
    global _TP
    _TP = info


def get_tp_info() -> TPInfo:
    return _TP


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (rank order)."""
    if _TP.size == 1:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
