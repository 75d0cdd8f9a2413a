"""A PEFT LoRA adapter on disk: `adapter_config.json` + `adapter_model.safetensors`.

Only what the engine can serve is accepted, each refusal a ValueError naming what to change:
plain LoRA (no DoRA, no trained biases, no extra saved modules) on the attention and MLP
projections, rank at most the engine's `max_lora_rank`. The scale is lora_alpha / r, or
lora_alpha / sqrt(r) with `use_rslora`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.<module path>.lora_A.weight (PEFT's names; `.default` where an adapter name was kept)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")


class AdapterNotFoundError(ValueError):
    """No adapter at the path given (HTTP 404 where the API server answers)."""

    status = 404


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class AdapterWeights:
    """The adapter's tensors by base-model module path (`model.layers.0.self_attn.q_proj`):
    A [r, in_features] and B [out_features, r], B already multiplied by the scale."""

    path: str
    config: AdapterConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_config(path: Path, max_rank: int) -> AdapterConfig:
    raw = json.loads((path / CONFIG_FILE).read_text())
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("rank_pattern", "rank_pattern"),
                     ("alpha_pattern", "alpha_pattern"), ("layers_to_transform", "layers_to_transform")):  # fmt: skip
        if raw.get(key):
            raise ValueError(f"{path}: adapters with {why} are not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{path}: adapters that train biases (bias={raw['bias']!r}) are not supported")
    rank = int(raw.get("r", 8))
    if rank < 1:
        raise ValueError(f"{path}: LoRA rank must be >= 1, got {rank}")
    if rank > max_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):  # PEFT also takes a regex or "all-linear": the weights say which
        targets = []
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"{path}: target modules {unknown} are not supported (supported: {', '.join(TARGET_MODULES)})")
    alpha = float(raw.get("lora_alpha", rank))
    return AdapterConfig(rank, alpha, bool(raw.get("use_rslora", False)), tuple(targets))


def read_adapter(path: str, max_rank: int) -> AdapterWeights:
    """Read and check an adapter directory (float32 tensors on the host)."""
    from safetensors.torch import load_file

    where = Path(path)
    if not (where / CONFIG_FILE).is_file():
        raise AdapterNotFoundError(f"no LoRA adapter at {path!r} ({CONFIG_FILE} not found)")
    if not (where / WEIGHTS_FILE).is_file():
        raise AdapterNotFoundError(f"no LoRA adapter at {path!r} ({WEIGHTS_FILE} not found)")
    config = read_config(where, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(where / WEIGHTS_FILE)).items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} (only lora_A / lora_B weights are supported)")
        module = match.group("module")
        if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise ValueError(f"{path}: {module} is not a supported target ({', '.join(TARGET_MODULES)})")
        pairs.setdefault(module, {})[match.group("which")] = tensor.float()
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{path}: {module} lacks its lora_A or lora_B weight")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise ValueError(f"{path}: {module} has rank {a.shape[0]}, the config says r={config.rank}")
        modules[module] = (a, b * config.scaling)
    if not modules:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    return AdapterWeights(path, config, modules)
