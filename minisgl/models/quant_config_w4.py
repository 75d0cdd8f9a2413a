"""A checkpoint's `quantization_config` for 4-bit weights (W4A16) as one typed scheme.

Three published layouts, each with its own fields in config.json:
- AWQ (`quant_method: awq`, AutoAWQ's GEMM packing, `version: gemm`): asymmetric, group-wise.
- GPTQ (`quant_method: gptq`, auto-gptq / GPTQModel): `sym`, `desc_act`, `group_size`;
  `checkpoint_format` `gptq` (v1: zero points stored minus one) or `gptq_v2` (stored as they are).
- compressed-tensors (`quant_method: compressed-tensors`, `format: pack-quantized`, llm-compressor):
  `config_groups` with int4 weights, `strategy: group` (or `channel`), no activation quantization.

`parse_w4_scheme` returns None for a checkpoint that is not 4-bit (no config, or compressed-tensors
float8 schemes: models/quant_config.py's), and raises ValueError for 4-bit variants we cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

W4Format = Literal["awq", "gptq", "compressed-tensors"]


@dataclass(frozen=True)
class W4Scheme:
    format: W4Format
    group_size: int | None  # None: one group over the whole input (per output channel)
    sym: bool
    desc_act: bool = False  # GPTQ act-order: each input row's group is read from g_idx
    zero_offset: int = 0  # added to a stored zero point (GPTQ v1 stores zero - 1)
    ignore: tuple[str, ...] = ()  # modules the config leaves in float (informational)

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size must be positive or per-channel, got {self.group_size}")


def parse_w4_scheme(config: dict[str, Any]) -> W4Scheme | None:
    """The 4-bit scheme of a model's config.json (the whole dict), or None when it has none."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    return None


def _bits(qc: dict[str, Any], method: str) -> None:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits}-bit weights are not supported (4-bit only)")


def _group(value: Any) -> int | None:
    size = int(value if value is not None else -1)
    return None if size == -1 else size


def _awq(qc: dict[str, Any]) -> W4Scheme:
    _bits(qc, "AWQ")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: only the GEMM packing (version 'gemm')")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not supported")
    skip = tuple(qc.get("modules_to_not_convert") or ())
    return W4Scheme("awq", _group(qc.get("group_size", qc.get("q_group_size", 128))), sym=False, ignore=skip)


def _gptq(qc: dict[str, Any]) -> W4Scheme:
    _bits(qc, "GPTQ")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return W4Scheme(
        "gptq",
        _group(qc.get("group_size", 128)),
        sym=bool(qc.get("sym", True)),
        desc_act=bool(qc.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _compressed_tensors(qc: dict[str, Any]) -> W4Scheme | None:
    groups = list((qc.get("config_groups") or {}).values())
    formats = {str(group.get("format") or qc.get("format") or "") for group in groups} or {str(qc.get("format", ""))}
    if "pack-quantized" not in formats:
        return None  # float8 and other compressed-tensors formats are not 4-bit
    if len(formats) != 1:
        raise ValueError(f"compressed-tensors checkpoints mixing formats {sorted(formats)} are not supported")
    weights = [group.get("weights") or {} for group in groups]
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder")
    if len({tuple(str(w.get(key)) for key in keys) for w in weights}) != 1:
        raise ValueError("compressed-tensors checkpoints with differing weight schemes per group are not supported")
    w = weights[0]
    if int(w.get("num_bits", 0)) != 4 or str(w.get("type", "int")) != "int":
        raise ValueError(f"pack-quantized weights of {w.get('num_bits')}-bit {w.get('type')} are not supported (int4 only)")
    if any(group.get("input_activations") for group in groups):
        raise ValueError("pack-quantized checkpoints with quantized activations are not supported (W4A16 only)")
    if w.get("actorder"):
        raise ValueError(f"pack-quantized actorder {w.get('actorder')!r} (weight_g_idx) is not supported")
    strategy = str(w.get("strategy", "group"))
    if strategy == "group":
        group_size = _group(w.get("group_size"))
        if group_size is None:
            raise ValueError("pack-quantized group strategy without a group_size")
    elif strategy == "channel":
        group_size = None
    else:
        raise ValueError(f"pack-quantized strategy {strategy!r} is not supported (group, channel)")
    return W4Scheme("compressed-tensors", group_size, sym=bool(w.get("symmetric", True)),
                    ignore=tuple(qc.get("ignore") or ()))  # fmt: skip
