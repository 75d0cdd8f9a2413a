"""Loading FP8 weights (models/quant_config.py's `Fp8Scheme`) into a built minisgl model.

A float8 checkpoint (`load_checkpoint`): `prepare_fp8` reads the tensor table (types only) and turns every layer
whose checkpoint weight is float8 (`F8_E4M3`) into float8 parameters plus a scale parameter
(layers/fp8.py: `to_fp8_params`), so the ordinary loader (models/loader.py) copies the file's
float8 weights and scales into them; `finish_fp8` then hands each layer its `Fp8LinearFn` (or
the experts their `Fp8MoeFn`). The layers the checkpoint keeps float (its `ignore` /
`modules_to_not_convert`: the LM head, MoE routers) are whatever the file stores in float.

`--quantization fp8` on a float checkpoint: `quantize_loaded` quantizes every loaded linear
layer per output channel (the experts, if any, stay float); `fp8_block` in 128x128 blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from torch import nn

from minisgl.layers.fp8 import Fp8Impl, finish_experts, finish_linear, quantize_linear, select_fp8_impl, to_fp8_params
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.moe import ExpertDown, ExpertGateUp, FusedExperts
from minisgl.models.loader import LazyTensor, iter_checkpoint, load_weights, target_of
from minisgl.models.quant_config import Fp8Scheme
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

_FP8_TYPES = ("F8_E4M3",)


class Fp8Plan(NamedTuple):
    scheme: Fp8Scheme
    layers: list[nn.Module]  # linear layers and expert stacks holding float8 parameters
    impl: Fp8Impl


def _weight_types(model_dir: Path) -> dict[str, str]:
    """{checkpoint tensor name: safetensors dtype} of every `*.weight`, from the file headers."""
    types: dict[str, str] = {}
    for name, tensor in iter_checkpoint(model_dir, show_progress=False, lazy=True):
        if name.endswith(".weight") and isinstance(tensor, LazyTensor):  # nothing is read
            types[name] = tensor.file_dtype
    return types


def load_checkpoint(model: nn.Module, model_dir: Path, show_progress: bool = True) -> dict[int, tuple[float, float]]:
    """`loader.load_weights`, with the layers a float8 checkpoint (the config's `quantization`)
    stores in float8 prepared before and finished after. Returns the KV cache scales."""
    scheme = getattr(model.config, "quantization", None)
    if not isinstance(scheme, Fp8Scheme):  # float weights, or 4-bit ones (the loader's W4Collector)
        return load_weights(model, model_dir, show_progress)
    plan = prepare_fp8(model, model_dir, scheme)
    kv_scales = load_weights(model, model_dir, show_progress)
    finish_fp8(model, plan)
    return kv_scales


def prepare_fp8(model: nn.Module, model_dir: Path, scheme: Fp8Scheme) -> Fp8Plan:
    """Before loading a float8 checkpoint: float8 parameters for every layer stored in float8."""
    modules = dict(model.named_modules())
    kinds: dict[str, set[bool]] = {}
    for name, dtype in _weight_types(model_dir).items():
        target = target_of(model, name)
        if target is None:
            continue
        owner = target[0].removesuffix(".weight")
        kinds.setdefault(owner, set()).add(dtype in _FP8_TYPES)
    layers: list[nn.Module] = []
    for owner, fp8 in sorted(kinds.items()):
        if True not in fp8:
            continue
        if False in fp8:
            raise ValueError(f"{owner}: the checkpoint stores some of its parts in float8 and some in float")
        layer = modules.get(owner)
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear, ExpertGateUp, ExpertDown)):
            raise ValueError(f"{owner}: float8 weights for a {type(layer).__name__}, which minisgl keeps float")
        if isinstance(layer, (ExpertGateUp, ExpertDown)) and scheme.weight != "block":
            raise ValueError(f"{owner}: float8 experts need block scales (weight_block_size), not per-{scheme.weight}")
        to_fp8_params(layer, scheme.weight, scheme.block, scheme.scale_suffix)
        layers.append(layer)
    if not layers:
        raise ValueError(f"the config says {scheme.source} fp8 but no checkpoint weight in {model_dir} is float8")
    return Fp8Plan(scheme, layers, select_fp8_impl(layers[0].weight.device))


def finish_fp8(model: nn.Module, plan: Fp8Plan) -> None:
    """After loading: each float8 layer computes through its float8 function."""
    group = plan.scheme.group
    held = set(map(id, plan.layers))
    for module in model.modules():
        if isinstance(module, FusedExperts) and id(module.gate_up_proj) in held:
            if id(module.down_proj) not in held:
                raise ValueError("float8 gate/up experts with float down experts")
            assert plan.scheme.block is not None
            finish_experts(module, plan.scheme.scale_suffix, plan.scheme.block[1])
    for layer in plan.layers:
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            finish_linear(layer, plan.scheme.scale_suffix, group, plan.impl)
    logger.info("fp8 weights (%s, per-%s scales, per-%s activations): %d layers, the %s GEMM",
                plan.scheme.source, plan.scheme.weight, plan.scheme.activation, len(plan.layers), plan.impl)  # fmt: skip


def quantize_loaded(model: nn.Module, block: tuple[int, int] | None = None) -> int:
    """`--quantization fp8` on a float checkpoint: every linear layer still holding a float weight
    becomes float8 with per-channel scales (`block`: one scale per block, `fp8_block`). Returns how many."""
    layers = [m for m in model.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not m.weight_held_by_fn]  # fmt: skip
    if not layers:
        return 0
    impl = select_fp8_impl(layers[0].weight.device)
    for layer in layers:
        quantize_linear(layer, impl, block)
    weights = "per-channel weights, per-token" if block is None else f"{block[0]}x{block[1]} weight blocks, per-token-group"
    logger.info("--quantization fp8%s: %d linear layers quantized at load (%s activations), the %s GEMM",
                "" if block is None else "_block", len(layers), weights, impl)  # fmt: skip
    return len(layers)
