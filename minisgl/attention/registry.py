"""Attention backends by name. A creator imports its module lazily and builds the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from minisgl.attention.base import BaseAttnBackend
from minisgl.kvcache.pool import KVPool
from minisgl.utils.registry import Registry

if TYPE_CHECKING:
    from minisgl.platform.base import BasePlatform

AttnCreator = Callable[[KVPool, int, int, int, float], BaseAttnBackend]
ATTN_BACKENDS: Registry[AttnCreator] = Registry("attention backend")


# `windows`: the backend runs per-layer sliding windows and soft-capped logits (AttnLayerSpec).
@ATTN_BACKENDS.register("torch", platforms=("cpu", "cuda"), windows=True)
def _create_torch(pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float) -> BaseAttnBackend:
    from minisgl.attention.torch_backend import TorchAttnBackend

    return TorchAttnBackend(pool, num_heads, num_kv_heads, head_dim, sm_scale)


@ATTN_BACKENDS.register("triton", platforms=("cuda", "cpu-interpret"), windows=True)
def _create_triton(pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float) -> BaseAttnBackend:
    if pool.k[0].device.type == "cpu":
        # Only reachable with TRITON_INTERPRET=1 (see select_attn_backend): set the interpreter
        # up before the kernels' module imports triton.
        from minisgl.kernels.interpret import use_triton_interpreter

        if not use_triton_interpreter():
            raise ValueError("triton was imported before the interpreter could be enabled")
    from minisgl.attention.triton_backend import create_triton_backend

    return create_triton_backend(pool, num_heads, num_kv_heads, head_dim, sm_scale)


def runs_windows(name: str) -> bool:
    """Whether backend `name` runs sliding-window and soft-capped attention layers."""
    return bool(ATTN_BACKENDS.meta(name).get("windows", False))


def select_attn_backend(requested: str | None, platform: BasePlatform) -> str:
    """Validate a requested backend name against the registry and platform, or pick the default."""
    if requested is None:
        return platform.default_attn
    if requested not in ATTN_BACKENDS.names():
        raise ValueError(f"unknown attention backend {requested!r}; choose from {', '.join(ATTN_BACKENDS.names())}")
    platforms = ATTN_BACKENDS.meta(requested).get("platforms", ())
    platform_name = platform.name
    interpreted = platform_name == "cpu" and platform.triton_interpret and "cpu-interpret" in platforms
    if platform_name in platforms or interpreted:
        return requested
    hint = " (set TRITON_INTERPRET=1 to run Triton kernels on the CPU, slowly)" if requested == "triton" else ""
    raise ValueError(f"attention backend {requested!r} does not run on {platform_name}{hint}")
