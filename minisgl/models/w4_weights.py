"""Load a 4-bit checkpoint (AWQ, GPTQ, compressed-tensors int4; models/quant_config_w4.py) with
its linear layers kept packed.

`load_weights` (models/loader.py) streams the checkpoint as usual and offers every tensor to a
`W4Collector` first: it keeps the quantized layers' tensors (by their format's suffixes: qweight,
qzeros, scales, g_idx / weight_packed, weight_scale, weight_zero_point, weight_shape), and at the
end converts each layer's into `W4Weight`s (models/w4_formats.py) and gives the layer a
`W4LinearFn` (layers/w4.py). Layers the checkpoint keeps in float (the LM head, embeddings,
norms, ignored modules) load as before. q|k|v and gate|up, quantized one by one in the file, are
joined along the outputs where their groups agree. One rank only (as the GGUF path).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from minisgl.kernels.w4_ref import W4Weight, concat_outputs
from minisgl.models.quant_config_w4 import W4Scheme, parse_w4_scheme
from minisgl.models.w4_formats import TENSOR_NAMES, to_w4
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

Part = str | int | None


class W4Collector:
    def __init__(self, model: nn.Module, scheme: W4Scheme) -> None:
        self.model, self.scheme = model, scheme
        self.suffixes = set(TENSOR_NAMES[scheme.format])
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)

    @staticmethod
    def for_checkpoint(model: nn.Module, model_dir: Path) -> W4Collector | None:
        """A collector when `model_dir`'s config.json says 4-bit weights, else None."""
        from minisgl.distributed import get_tp_info

        config_path = Path(model_dir) / "config.json"
        if not config_path.is_file():
            return None
        scheme = parse_w4_scheme(json.loads(config_path.read_text()))
        if scheme is None:
            return None
        if get_tp_info().size != 1:
            raise ValueError(f"{scheme.format} 4-bit checkpoints run at one rank for now: pass --tp 1")
        return W4Collector(model, scheme)

    def take(self, name: str, tensor: object) -> bool:
        """Keep `name` if it is part of a quantized layer (or a quantized layer's all-zero bias,
        which auto-gptq writes for layers that have none); False: load it as usual."""
        prefix, _, suffix = name.rpartition(".")
        if suffix == "bias":
            return self._zero_bias(name, tensor)
        if suffix not in self.suffixes:
            return False
        self.pending[prefix][suffix] = _materialize(tensor)
        return True

    def _zero_bias(self, name: str, tensor: object) -> bool:
        from minisgl.models.loader import target_of

        target = target_of(self.model, name)
        if target is None or target[0] in self.params:
            return False
        return not bool(_materialize(tensor).any())

    def finish(self, loaded: set[str]) -> None:
        """Give each quantized layer its packed weight; adds the parameters it covers to `loaded`."""
        from minisgl.layers.w4 import W4LinearFn
        from minisgl.models.loader import target_of

        by_owner: dict[str, list[tuple[Part, W4Weight]]] = defaultdict(list)
        for prefix, tensors in self.pending.items():
            target = target_of(self.model, prefix + ".weight")
            if target is None:
                continue
            param_name, part = target
            owner = param_name.removesuffix(".weight")
            module = self.model.get_submodule(owner) if param_name in self.params else None
            if module is None or not hasattr(module, "use_weight_fn"):
                raise ValueError(f"checkpoint layer {prefix!r} is 4-bit but {owner!r} is not a linear layer of the model")
            by_owner[owner].append((part, to_w4(self.scheme, tensors, prefix)))
        nbytes, impl = 0, "none"
        for owner, parts in by_owner.items():
            module = self.model.get_submodule(owner)
            ordered = _ordered(owner, module, parts)
            weight = module.weight
            n, k = sum(w.out_features for w in ordered), ordered[0].in_features
            if (n, k) != tuple(weight.shape):
                raise ValueError(f"{owner}: 4-bit weight of {n}x{k}, the layer is {tuple(weight.shape)}")
            fn = W4LinearFn(concat_outputs([w.to(weight.device, torch.float32) for w in ordered]))
            module.use_weight_fn(fn)  # type: ignore[operator]
            loaded.update(f"{owner}.weight" if part is None else f"{owner}.weight:{part}" for part, _ in parts)
            nbytes, impl = nbytes + fn.nbytes, fn.impl
        logger.info("%s 4-bit weights kept packed: %d layers, %.1f MB (group %s, %s%s), %s kernel",
                    self.scheme.format, len(by_owner), nbytes / 1e6, self.scheme.group_size or "per-channel",
                    "sym" if self.scheme.sym else "asym", ", act-order" if self.scheme.desc_act else "",
                    impl)  # fmt: skip


def _materialize(tensor: object) -> torch.Tensor:
    from minisgl.models.loader import LazyTensor

    return tensor.materialize() if isinstance(tensor, LazyTensor) else tensor  # type: ignore[return-value]


def _ordered(owner: str, module: nn.Module, parts: list[tuple[Part, W4Weight]]) -> list[W4Weight]:
    """The parts in the layer's output order; every part of a fused layer must be quantized."""
    from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    expected: list[Part]
    if isinstance(module, QKVParallelLinear):
        expected = ["q", "k", "v"]
    elif isinstance(module, MergedColumnParallelLinear):
        expected = list(range(len(module.part_per_rank)))
    else:
        expected = [None]
    by_part = {str(part): w for part, w in parts}
    if sorted(by_part) != sorted(map(str, expected)):
        raise ValueError(f"{owner}: 4-bit parts {sorted(by_part)} in the checkpoint, the layer fuses {expected}: "
                         "a fused layer's parts must all be quantized")  # fmt: skip
    return [by_part[str(part)] for part in expected]
