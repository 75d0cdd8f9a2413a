"""Load Hugging Face safetensors checkpoints (or dummy weights) into a minisgl model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm import tqdm

from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _checkpoint_files(model_dir)
    handles = [safe_open(str(path), framework="pt") for path in files]
    total = sum(len(list(handle.keys())) for handle in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def _target(model: nn.Module, name: str) -> tuple[str, str | int | None] | None:
    """Map a checkpoint name to (parameter name, fused part) or None to skip it."""
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
        return None
    stacked: dict[str, tuple[str, str | int]] = getattr(model, "stacked_params", {})
    for ckpt_part, (fused, part) in stacked.items():
        token = f".{ckpt_part}."
        if token in name:
            return name.replace(token, f".{fused}."), part
    return name, None


def load_weights(model: nn.Module, model_dir: Path, show_progress: bool = True) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(model_dir, show_progress):
        target = _target(model, name)
        if target is None:
            continue
        param_name, part = target
        param = params.get(param_name)
        if param is None:
            extra = getattr(model, "load_extra_weight", None)
            if extra is not None and extra(name, tensor):
                loaded.add(name)
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
                param.data.copy_(tensor)
            elif part is None:
                loader(param, tensor)
            else:
                loader(param, tensor, part)
        loaded.add(param_name if part is None else f"{param_name}:{part}")
    missing = _missing(model, loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")


def _missing(model: nn.Module, loaded: set[str]) -> set[str]:
    seen = {name.split(":")[0] for name in loaded}
    # named_parameters() lists a tied lm_head once, under the embedding's name.
    return {name for name, _ in model.named_parameters()} - seen


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights from the config alone (benchmarks): small normal values, norms at one."""
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Generated where the parameter lives: an 8B model's weights on a CPU RNG take minutes.
            generator = torch.Generator(device=param.device).manual_seed(seed * 100003 + index)
            param.normal_(0.0, 0.02, generator=generator)
