"""Which tensor-parallel sizes a model can be split into, checked before any process starts.

The layers split attention heads, key/value heads (replicated when there are fewer than ranks)
and MLP / expert intermediate rows evenly; the vocabulary is padded, so it never blocks a size.
A size that does not fit is refused at launch with the sizes that would, instead of a rank
failing (or hanging its peers) later.
"""

from __future__ import annotations

from typing import NamedTuple


class ShardedDims(NamedTuple):
    """The dimensions of a model that tensor parallelism divides."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int  # 0: no dense MLP layer
    moe_intermediate_size: int = 0  # 0: no expert layer


def tp_problems(dims: ShardedDims, tp: int) -> list[str]:
    """Why `tp` ranks cannot split the model (empty: they can)."""
    problems = []
    if dims.num_heads % tp:
        problems.append(f"its {dims.num_heads} attention heads")
    kv = dims.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"its {kv} key/value heads (a smaller size must divide them, a larger one be a multiple)")
    if dims.intermediate_size and dims.intermediate_size % tp:
        problems.append(f"its MLP intermediate size {dims.intermediate_size}")
    if dims.moe_intermediate_size and dims.moe_intermediate_size % tp:
        problems.append(f"its expert intermediate size {dims.moe_intermediate_size}")
    return problems


def valid_tp_sizes(dims: ShardedDims, limit: int = 64) -> list[int]:
    return [tp for tp in range(1, limit + 1) if not tp_problems(dims, tp)]


def check_tp_size(dims: ShardedDims, tp: int, option: str = "--tp") -> None:
    """Raise ValueError naming what does not divide and the sizes that would work."""
    problems = tp_problems(dims, tp)
    if not problems:
        return
    sizes = valid_tp_sizes(dims)
    choices = ", ".join(str(s) for s in sizes[:-1]) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    raise ValueError(f"{option} {tp} cannot split this model ({tp} does not divide {' and '.join(problems)}); "
                     f"use {option} {choices}")  # fmt: skip
