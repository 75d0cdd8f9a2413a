"""`resolve(config, platform)`: the engine's `auto` choices made once, for one platform.

Pure: it reads the config and the platform's facts and returns a new config
(`dataclasses.replace`); the engine and its layers read only the resolved fields.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from minisgl.attention.registry import select_attn_backend
from minisgl.engine.config import EngineConfig
from minisgl.platform.kernel_config import resolve_kernels

if TYPE_CHECKING:
    from minisgl.platform.base import BasePlatform


def resolve(config: EngineConfig, platform: BasePlatform) -> EngineConfig:
    """`dtype` and `attn` named, `pad_eager` decided, and the kernel switches reduced to what the
    platform runs (folded norms only with the triton backend, whose kernels finish the norms)."""
    dtype = config.dtype if config.dtype != "auto" else str(platform.default_dtype).removeprefix("torch.")
    attn = select_attn_backend(config.attn, platform)
    pad_eager = platform.pad_eager if config.pad_eager is None else config.pad_eager
    kernels = resolve_kernels(config.kernels, platform)
    kernels = replace(kernels, fold_norms=kernels.fold_norms and attn == "triton")
    return replace(config, dtype=dtype, attn=attn, pad_eager=pad_eager, kernels=kernels)  # type: ignore[arg-type]
