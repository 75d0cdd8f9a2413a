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
    """`weights`, `dtype` and `attn` named, `pad_eager` decided, and the kernel switches reduced to
    what the platform runs (folded norms only with the triton backend, whose kernels finish the
    norms; the C++ CPU decode attention over fp32 caches for GGUF weights kept quantized)."""
    weights, dtype = resolve_weights(config, platform)
    attn = select_attn_backend(config.attn, platform)
    pad_eager = platform.pad_eager if config.pad_eager is None else config.pad_eager
    # GGUF blocks kept quantized are not the exact mode: unless told, their fp32 decode attention
    # takes the C++ kernel too.
    fp32_attn = config.kernels.cpu_kernels_fp32
    kernels = replace(config.kernels, cpu_kernels_fp32=weights == "gguf" if fp32_attn is None else fp32_attn)
    kernels = resolve_kernels(kernels, platform)
    # Not with LoRA: an adapter's A reads the normalised rows the folded projections never see.
    kernels = replace(kernels, fold_norms=kernels.fold_norms and attn == "triton" and not config.lora)
    return replace(config, weights=weights, dtype=dtype, attn=attn, pad_eager=pad_eager, kernels=kernels)  # type: ignore[arg-type]


def resolve_weights(config: EngineConfig, platform: BasePlatform) -> tuple[str, str]:
    """(weights, dtype): "gguf" with float32 activations, or a dequantized model's dtype twice.
    A choice that cannot run here is a ValueError that names the flag to change."""
    platform_dtype = str(platform.default_dtype).removeprefix("torch.")
    weights = config.weights
    if weights == "auto":
        quantized = (config.gguf_model and platform.name == "cpu" and config.tp_size == 1 and config.dtype == "auto"
                     and not config.dummy_weights and not config.lora and config.quantization == "auto")  # fmt: skip
        if quantized:
            return "gguf", "float32"
        dtype = platform_dtype if config.dtype == "auto" else config.dtype
        return dtype, dtype
    if weights == "gguf":
        _check_gguf(config, platform)
        return "gguf", "float32"
    if config.dtype not in ("auto", weights):
        raise ValueError(f"--weights {weights} and --dtype {config.dtype} disagree: pass one of them")
    return weights, weights


def _check_gguf(config: EngineConfig, platform: BasePlatform) -> None:
    if not config.gguf_model:
        raise ValueError(f"--weights gguf needs a .gguf model, got {config.model}: pass --weights float32 or bfloat16")
    if config.dummy_weights:
        raise ValueError("--weights gguf keeps a GGUF file's blocks; --dummy-weights has none: pass --weights float32")
    if platform.name != "cpu":
        raise ValueError("--weights gguf runs on the quantized CPU kernels only: on a GPU pass --weights bfloat16")
    if config.quantization != "auto":
        raise ValueError(f"--weights gguf keeps the GGUF's blocks: for --quantization {config.quantization} pass "
                         "--weights float32 or bfloat16")  # fmt: skip
    if config.tp_size != 1:
        raise ValueError(f"--weights gguf runs at one rank: for --tp {config.tp_size} pass --weights float32 or bfloat16")
    if config.dtype not in ("auto", "float32"):
        raise ValueError(f"--weights gguf computes in float32: drop --dtype {config.dtype} or pass --weights {config.dtype}")
