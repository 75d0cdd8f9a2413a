"""The C++ CPU libraries the kernel tests run, built (or loaded from their cache) once per module,
and the scattered token tables their paged cases read.
A failed build fails the test loudly instead of skipping it: the suite's machines have a C++
compiler (the README's setup), so a failure here is a broken source, not a missing toolchain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T")


def build(load: Callable[..., T], **kwargs: Any) -> T:
    try:
        return load(**kwargs)
    except RuntimeError as exc:
        pytest.fail(f"building the C++ CPU kernels failed (needs a C++ compiler, g++ or clang++): {exc}", pytrace=False)


def scattered_table(lens: list[int], slots_total: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token table whose requests (lengths `lens`) hold 16-slot pages drawn at random from
    `slots_total` slots, in rows out of order: (table [len(lens) + 2, width] int32, rows [B])."""
    table = torch.zeros(len(lens) + 2, width, dtype=torch.int32)
    pages = torch.randperm(slots_total // 16)
    used = 0
    rows = torch.tensor([len(lens) + 1 - i for i in range(len(lens))])  # rows out of order
    for i, n in enumerate(lens):
        count = -(-n // 16)
        slots = (pages[used : used + count, None] * 16 + torch.arange(16)).reshape(-1)[:n]
        used += count
        table[rows[i], :n] = slots.int()
    return table, rows
