"""A checkpoint's `quantization_config` (config.json) as a typed scheme (no torch here).

`parse_quant_config` turns the dict into one `QuantScheme` or None (an unquantized checkpoint),
and refuses, with the reason, what minisgl does not run. FP8 (W8A8, float8 e4m3) comes in:

- compressed-tensors `float-quantized` (llm-compressor's FP8-Dynamic and FP8-Block): weights
  `<layer>.weight` float8 with `<layer>.weight_scale`, per tensor ([1]), per output channel
  ([N, 1]) or per 128x128 block ([N/128, K/128]); activations quantized at run time, per token
  (or per token and 128-group with block weights); modules in `ignore` stay unquantized.
- `quant_method: fp8` (transformers' fine-grained FP8: Qwen3-*-FP8, DeepSeek-V3): weights with
  `<layer>.weight_scale_inv` per `weight_block_size` block ([N/128, K/128]), or one per tensor
  without a block size; activations per token and 128-group (`activation_scheme: dynamic`).

Each scale multiplies (`weight_scale_inv` too: value = float8 * scale). `--quantization fp8`
on a float checkpoint makes the scheme `load_time_fp8()` (per-channel weights, per-token
activations), quantized by the loader. 4-bit integer weights (AWQ, GPTQ, pack-quantized) are
`W4Scheme` (models/quant_config_w4.py); GPT-OSS's `quant_method: mxfp4` experts are `Mxfp4Scheme`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from minisgl.models.quant_config_w4 import W4Scheme, parse_w4_scheme

WeightGranularity = Literal["tensor", "channel", "block"]
# Dynamic activation scales: one per token, or one per token and K-group (the block's width).
ActivationGranularity = Literal["token", "group"]


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 W8A8: float8 e4m3 weights with `scale_suffix` scales at `weight` granularity, activations
    quantized dynamically at `activation` granularity."""

    source: Literal["compressed-tensors", "fp8", "load"]
    weight: WeightGranularity
    activation: ActivationGranularity
    block: tuple[int, int] | None = None  # (rows, cols) of a weight block
    scale_suffix: str = "weight_scale"
    # Modules the checkpoint leaves float (for the record: which layers load as float8 is read
    # from the checkpoint's tensor types, models/quant_fp8.py).
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.weight == "block") != (self.block is not None):
            raise ValueError(f"fp8 weights per {self.weight} with block {self.block}")
        if self.activation == "group" and self.block is None:
            raise ValueError("per-group activation scales need a weight block size")

    @property
    def group(self) -> int | None:
        """The K-group of the activation (and weight) scales; None: one scale per token / row."""
        return self.block[1] if self.activation == "group" and self.block is not None else None


@dataclass(frozen=True)
class Mxfp4Scheme:
    """MXFP4 (OCP microscaling FP4, kernels/mxfp4.py): GPT-OSS's routed experts as `<param>_blocks`
    (e2m1 codes, two a byte) and `<param>_scales` (one e8m0 power of two per 32 inputs). The
    experts stay 4-bit where layers/moe_swiglu.py's fused kernel serves, else are dequantized at
    load; every other module stays float."""

    ignore: tuple[str, ...] = ()  # the modules the checkpoint leaves float (informational)


# A checkpoint's quantized weights: FP8 (W8A8, layers/fp8.py), 4-bit integer (W4A16, layers/w4.py)
# or MXFP4 experts (GPT-OSS, layers/moe_swiglu.py).
QuantScheme = Fp8Scheme | W4Scheme | Mxfp4Scheme


def load_time_fp8() -> Fp8Scheme:
    """`--quantization fp8` on a float checkpoint: per-channel weight scales computed at load,
    per-token dynamic activations."""
    return Fp8Scheme(source="load", weight="channel", activation="token")


def parse_quant_config(cfg: dict[str, Any] | None) -> QuantScheme | None:
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method == "fp8":
        return _parse_fp8(cfg)
    if method in ("awq", "gptq") or (method == "compressed-tensors" and cfg.get("format") == "pack-quantized"):
        w4 = parse_w4_scheme({"quantization_config": cfg})
        if w4 is None:
            raise ValueError(f"{method} {cfg.get('format') or ''} quantization_config without int4 weight groups: "
                             "minisgl reads 4-bit pack-quantized, AWQ and GPTQ weights")  # fmt: skip
        return w4
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == "mxfp4":
        return Mxfp4Scheme(ignore=tuple(str(m) for m in cfg.get("modules_to_not_convert") or ()))
    raise ValueError(f"unsupported quantization_config quant_method {method!r}; minisgl runs fp8, awq, gptq, "
                     "compressed-tensors float-quantized (FP8) / pack-quantized (int4) and (GPT-OSS) mxfp4 "
                     "checkpoints")  # fmt: skip


def _parse_fp8(cfg: dict[str, Any]) -> Fp8Scheme:
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 checkpoint with activation_scheme {cfg.get('activation_scheme')!r}: "
                         "only dynamic activation scales are supported")  # fmt: skip
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint in format {cfg.get('fmt')!r}: only e4m3 is supported")
    ignore = tuple(str(m) for m in cfg.get("modules_to_not_convert") or ())
    block = cfg.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "tensor", "token", scale_suffix="weight_scale_inv", ignore=ignore)
    if len(block) != 2 or not all(int(b) > 0 for b in block):
        raise ValueError(f"fp8 weight_block_size must be two positive sizes, got {block}")
    return Fp8Scheme("fp8", "block", "group", (int(block[0]), int(block[1])), "weight_scale_inv", ignore)


def _parse_compressed_tensors(cfg: dict[str, Any]) -> Fp8Scheme | None:
    fmt = cfg.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (FP8: float-quantized)")
    groups = list((cfg.get("config_groups") or {}).values())
    if not groups:
        return None  # a KV-cache scheme alone (an FP8-KV checkpoint: models/loader.py reads its scales)
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups: one (targets Linear) is supported")
    group = groups[0]
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
        raise ValueError(f"compressed-tensors float-quantized weights of {weights.get('num_bits')} bits "
                         f"({weights.get('type')}): 8-bit float is supported")  # fmt: skip
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors fp8 weights must be symmetric")
    if inputs is None:
        raise ValueError("compressed-tensors fp8 weight-only (W8A16) checkpoints are not supported: W8A8 is")
    if not inputs.get("dynamic") or inputs.get("type") != "float" or int(inputs.get("num_bits", 0)) != 8:
        raise ValueError("compressed-tensors fp8 with static input scales is not supported: "
                         "dynamic per-token activations (FP8-Dynamic) are")  # fmt: skip
    ignore = tuple(str(m) for m in cfg.get("ignore") or ())
    strategy, act = weights.get("strategy"), inputs.get("strategy")
    if strategy in ("tensor", "channel"):
        if act != "token":
            raise ValueError(f"compressed-tensors fp8 input strategy {act!r} with {strategy} weights: token is supported")
        return Fp8Scheme("compressed-tensors", strategy, "token", ignore=ignore)
    if strategy == "block":
        block = weights.get("block_structure") or []
        if len(block) != 2 or act != "group" or int(inputs.get("group_size") or 0) != int(block[1]):
            raise ValueError(f"compressed-tensors fp8 block weights {block} need per-group inputs of the block width")
        return Fp8Scheme("compressed-tensors", "block", "group", (int(block[0]), int(block[1])), ignore=ignore)
    raise ValueError(f"compressed-tensors fp8 weight strategy {strategy!r} is not supported (tensor, channel, block)")
