"""Load Hugging Face safetensors checkpoints (or dummy weights) into a minisgl model."""

from __future__ import annotations

import json
import re
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


class LazyTensor:
    """A checkpoint tensor not read yet: `narrow` (and slicing dim 0) read only that range from the
    file, so a tensor-parallel rank reads its shard, not the whole tensor. Anything else calls
    `materialize()` for the full tensor."""

    def __init__(self, handle: object, name: str) -> None:
        self.name = name
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.shape = torch.Size(self._slice.get_shape())
        self.file_dtype: str = self._slice.get_dtype()  # safetensors' name: "BF16", "F8_E4M3", ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        assert isinstance(rows, slice), "lazy checkpoint tensors slice along dim 0 only"
        return self._slice[rows]

    def materialize(self) -> torch.Tensor:
        return self._slice[:]


def iter_checkpoint(
    model_dir: Path, show_progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    from safetensors import safe_open

    files = _checkpoint_files(model_dir)
    handles = [safe_open(str(path), framework="pt") for path in files]
    total = sum(len(list(handle.keys())) for handle in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, (LazyTensor(handle, name) if lazy else handle.get_tensor(name))
                bar.update(1)


def _takes_lazy(param: nn.Parameter) -> bool:
    """Loaders that only narrow or slice what they get (the TP-sharded linear layers, the
    vocabulary-parallel embedding and the experts' intermediate-dim shards); everything else
    (norms, the router: replicated on every rank) gets the full tensor."""
    from minisgl.layers.embedding import VocabParallelEmbedding
    from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
    from minisgl.layers.moe import ExpertDown, ExpertGateUp

    owner = getattr(getattr(param, "weight_loader", None), "__self__", None)
    return isinstance(owner, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ExpertGateUp, ExpertDown))


# What a decoder saved as its base model (`*Model`, no LM head) names its tensors with.
_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def _target(model: nn.Module, name: str) -> tuple[str, str | int | None] | None:
    """Map a checkpoint name to (parameter name, fused part) or None to skip it. A model may
    rename or skip checkpoint tensors first (`checkpoint_name`: Gemma 3's multimodal layout)."""
    rename = getattr(model, "checkpoint_name", None)
    if rename is not None:
        renamed = rename(name)
        if renamed is None:
            return None
        name = renamed
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
        return None
    if name.startswith("lm_head.") and getattr(model, "lm_head", True) is None:
        return None  # served without its LM head (embeddings)
    if name.startswith(_BARE_PREFIXES) and hasattr(model, "model"):
        name = "model." + name  # a base model's checkpoint (`Qwen3Model`): no `model.` prefix
    stacked: dict[str, tuple[str, str | int]] = getattr(model, "stacked_params", {})
    for ckpt_part, (fused, part) in stacked.items():
        token = f".{ckpt_part}."
        if token in name:
            return name.replace(token, f".{fused}."), part
        if name.endswith(token[:-1]):  # a bare parameter's part (GPT-OSS's `experts.down_proj_blocks`)
            return name[: -len(ckpt_part)] + fused, part
    return name, None


# Per-layer KV cache scales of an FP8-KV checkpoint: `self_attn.k_scale` / `v_scale` (vLLM's and
# llm-compressor's names), the older `k_proj.output_scale` / `v_proj.output_scale`, and one
# `kv_scale` for both.
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when `name` is a KV cache scale."""
    match = _KV_SCALE.search(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or match.group(3)


def load_weights(model: nn.Module, model_dir: Path, show_progress: bool = True) -> dict[int, tuple[float, float]]:
    """Load the checkpoint into `model`; returns the KV cache scales it holds, {layer: (k, v)}
    (empty for most checkpoints; a float8 KV pool uses them). `--weights gguf` loads with
    models/gguf_weights.py instead, which reuses `load_tensor` and `check_complete`."""
    from minisgl.distributed import get_tp_info
    from minisgl.models.w4_weights import W4Collector

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    kv_scales: dict[int, dict[str, float]] = {}
    # With TP, sharded layers read only their rank's slice from the file.
    lazy = get_tp_info().size > 1
    w4 = W4Collector.for_checkpoint(model, model_dir)  # 4-bit layers kept packed (models/w4_weights.py)
    for name, tensor in iter_checkpoint(model_dir, show_progress, lazy=lazy):
        if w4 is not None and w4.take(name, tensor):
            continue
        scale_of = kv_scale_target(name)
        if scale_of is not None:
            value = tensor.materialize() if isinstance(tensor, LazyTensor) else tensor
            layer, which = scale_of
            for part in ("k", "v") if which == "kv" else (which,):
                kv_scales.setdefault(layer, {})[part] = float(value.float().max())
            continue
        load_tensor(model, params, name, tensor, loaded)
    if w4 is not None:
        w4.finish(loaded)
    check_complete(model, loaded, f"checkpoint in {model_dir}")
    return {layer: (parts.get("k", 1.0), parts.get("v", 1.0)) for layer, parts in kv_scales.items()}


def load_tensor(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor | LazyTensor,
                loaded: set[str]) -> None:  # fmt: skip
    """One checkpoint tensor (HF name) into its parameter (through the layer's loader); adds what
    it filled to `loaded`."""
    target = _target(model, name)
    if target is None:
        return
    param_name, part = target
    param = params.get(param_name)
    if isinstance(tensor, LazyTensor) and (param is None or not _takes_lazy(param)):
        tensor = tensor.materialize()
    if param is None:
        extra = getattr(model, "load_extra_weight", None)
        if extra is not None and extra(name, tensor):
            loaded.add(name)
            return
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
    loader = getattr(param, "weight_loader", None)
    parts = _fused_parts(model, param_name) if part is None else None
    if parts is not None and loader is not None:
        # A projection fused in the checkpoint (Phi-3's qkv_proj): each part through the
        # fused layer's loader, which takes this rank's slice of it.
        full = tensor.materialize() if isinstance(tensor, LazyTensor) else tensor
        _load_fused(loader, param, full, parts, name)
        loaded.update(f"{param_name}:{p}" for p, _ in parts)
        return
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


def check_complete(model: nn.Module, loaded: set[str], source: str) -> None:
    missing = _missing(model, loaded)
    if missing:
        raise ValueError(f"{source} lacks weights for: {', '.join(sorted(missing)[:8])}")


def target_of(model: nn.Module, name: str) -> tuple[str, str | int | None] | None:
    """(parameter name, fused part) of a checkpoint tensor, or None for one the model skips."""
    return _target(model, name)


def _fused_parts(model: nn.Module, param_name: str) -> list[tuple[str | int, int]] | None:
    fused: dict[str, list[tuple[str | int, int]]] = getattr(model, "fused_params", {})
    for suffix, parts in fused.items():
        if f".{suffix}." in param_name:
            return parts
    return None


def _load_fused(loader, param: nn.Parameter, full: torch.Tensor, parts: list[tuple[str | int, int]], name: str) -> None:  # type: ignore[no-untyped-def]
    if full.shape[0] != sum(size for _, size in parts):
        raise ValueError(f"{name}: {full.shape[0]} rows, the config's parts add up to {sum(s for _, s in parts)}")
    offset = 0
    with torch.no_grad():
        for part, size in parts:
            loader(param, full.narrow(0, offset, size), part)
            offset += size


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
            fill = getattr(param, "dummy_init", None)  # quantized storage (GPT-OSS's MXFP4 codes)
            if fill is not None:
                fill(param, generator)
                continue
            param.normal_(0.0, 0.02, generator=generator)
