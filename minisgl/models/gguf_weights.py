"""`--weights gguf`: load a GGUF's tensors into a minisgl model with the quantized ones kept as
their blocks, for the quantized CPU kernels (kernels/cpu_quant.py, layers/quant.py).

The same plan as the float conversion (gguf.py: `plan_tensors`, HF names, q/k rotary rows
un-permuted: a row permutation, which applies to rows of blocks as it does to float rows). Each
linear layer whose weight parts are all of a kernel type (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) gets them
as row blocks: q|k|v and gate|up concatenated by rows where their types match (blocks are per
row), kept as separate matrices where they do not. The token embedding and the LM head (tied or
not) become `QuantEmbedding` / `QuantLMHead` over their blocks. Everything else (norms, F32/F16
tensors, types without a kernel such as Q5_K, MoE experts) is dequantized to float as before.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from minisgl.kernels.quant_ref import QUANT_TYPES
from minisgl.models.errors import ModelSourceError
from minisgl.models.gguf import TensorPlan, gguf_arch, materialize, plan_tensors, unpermute_rows
from minisgl.models.gguf_table import GGUFTable
from minisgl.models.loader import check_complete, load_tensor, target_of
from minisgl.utils.logging import get_logger

if TYPE_CHECKING:
    from minisgl.kernels.cpu_quant import QuantMatrix, QuantOp

logger = get_logger(__name__)

Part = str | int | None


def load_gguf_weights(model: nn.Module, gguf_path: Path, show_progress: bool = True) -> None:
    from minisgl.layers.quant import quant_op

    start = time.perf_counter()
    reader = GGUFTable(gguf_path)  # the tensor table alone: gguf.GGUFReader takes seconds to open
    config = model.config  # type: ignore[attr-defined]
    plans = plan_tensors(reader, gguf_arch(reader, gguf_path), config.num_heads, config.num_kv_heads)  # type: ignore[arg-type]
    params = dict(model.named_parameters(remove_duplicate=False))
    held, rest = _split(model, plans)
    try:
        op = quant_op()
    except RuntimeError as exc:  # no compiler
        raise ModelSourceError(f"--weights gguf: {exc}; pass --weights float32 to run dequantized") from exc
    except ValueError as exc:  # a --cpu-isa this CPU cannot run
        raise ModelSourceError(f"--cpu-isa: {exc}; pass --cpu-isa auto") from exc
    loaded: set[str] = set()
    for plan, values in materialize(rest) if rest else ():
        load_tensor(model, params, plan.hf_name, torch.from_numpy(np.array(values)), loaded)
    nbytes = 0
    for owner, parts in held.items():
        nbytes += _hold(model, owner, parts, op, loaded)
    check_complete(model, loaded, f"GGUF file {gguf_path}")
    types = sorted({plan.source.tensor_type.name for parts in held.values() for _, plan in parts})
    logger.info(
        "GGUF weights kept quantized: %d layers (%s, %.1f MB of blocks), %d tensors dequantized; "
        "quantized CPU kernels on the %s path (this CPU runs: %s); loaded in %.1f s",
        len(held), "/".join(types), nbytes / 1e6, len(rest), op.isa, ", ".join(op.lib.supported),
        time.perf_counter() - start,
    )  # fmt: skip


def _split(model: nn.Module, plans: list[TensorPlan]) -> tuple[dict[str, list[tuple[Part, TensorPlan]]], list[TensorPlan]]:
    """({owner module path: [(part, plan)]} for the weights kept as blocks, the plans to dequantize)."""
    from minisgl.layers.embedding import VocabParallelEmbedding
    from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear

    held: dict[str, list[tuple[Part, TensorPlan]]] = defaultdict(list)
    rest: list[TensorPlan] = []
    for plan in plans:
        target = target_of(model, plan.hf_name)
        kernel_type = plan.source.tensor_type.name in QUANT_TYPES and plan.expert is None
        if target is None or not kernel_type or not target[0].endswith(".weight"):
            rest.append(plan)
            continue
        owner = target[0].removesuffix(".weight")
        module = model.get_submodule(owner)
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            held[owner].append((target[1], plan))
        else:
            rest.append(plan)
    for owner in list(held):
        expected = _parts(model.get_submodule(owner))
        if sorted(map(str, (part for part, _ in held[owner]))) != sorted(map(str, expected)):
            # Some part is F16/F32 or of a type without a kernel: the whole layer goes float.
            rest.extend(plan for _, plan in held.pop(owner))
    return dict(held), rest


def _parts(module: nn.Module) -> list[Part]:
    from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(len(module.part_per_rank)))
    return [None]


def _rows(plan: TensorPlan) -> np.ndarray:
    """The tensor's blocks as rows [n, row_bytes], in the HF row order."""
    rows = np.asarray(plan.source.data).reshape(plan.shape[0], -1)
    return unpermute_rows(rows, plan.unpermute_heads) if plan.unpermute_heads is not None else rows


def _matrices(parts: list[tuple[Part, TensorPlan]], order: list[Part]) -> list[QuantMatrix]:
    """The parts' blocks in the layer's row order; neighbours of one type concatenated by rows
    (in numpy: torch.cat of uint8 runs ~300x slower)."""
    from minisgl.kernels.cpu_quant import QuantMatrix

    by_part = {str(part): plan for part, plan in parts}
    groups: list[list[TensorPlan]] = []
    for part in order:
        plan = by_part[str(part)]
        if groups and groups[-1][0].source.tensor_type == plan.source.tensor_type:
            groups[-1].append(plan)
        else:
            groups.append([plan])
    matrices = []
    for group in groups:
        rows = np.concatenate([_rows(plan) for plan in group]) if len(group) > 1 else np.array(_rows(group[0]))
        qm = QuantMatrix.create(torch.from_numpy(rows), group[0].source.tensor_type.name)
        expected = (sum(plan.shape[0] for plan in group), group[0].shape[1])
        if (qm.n, qm.k) != expected:
            raise ModelSourceError(f"GGUF tensor {group[0].source.name}: blocks of {qm.n}x{qm.k}, expected {expected}")
        matrices.append(qm)
    return matrices


def _hold(model: nn.Module, owner: str, parts: list[tuple[Part, TensorPlan]], op: QuantOp, loaded: set[str]) -> int:
    """Give one layer its blocks; the bytes they take."""
    from minisgl.layers.embedding import ParallelLMHead
    from minisgl.layers.quant import QuantEmbedding, QuantLinearFn, QuantLMHead

    module = model.get_submodule(owner)
    matrices = _matrices(parts, _parts(module))
    weight = module.weight
    if sum(qm.n for qm in matrices) != weight.shape[0] or matrices[0].k != weight.shape[1]:
        raise ModelSourceError(f"{owner}: GGUF blocks of {sum(qm.n for qm in matrices)}x{matrices[0].k}, "
                               f"the layer is {tuple(weight.shape)}")  # fmt: skip
    loaded.update(f"{owner}.weight" if part is None else f"{owner}.weight:{part}" for part, _ in parts)
    if not hasattr(module, "use_weight_fn"):  # the vocabulary layers: replaced by their quantized kind
        vocab = model.config.vocab_size  # type: ignore[attr-defined]
        (qm,) = matrices
        if isinstance(module, ParallelLMHead):
            _replace(model, owner, QuantLMHead(qm, vocab, op))
        else:
            _replace(model, owner, QuantEmbedding(qm, vocab, op))
            head = getattr(model, "lm_head", None)
            if model.config.tie_word_embeddings and isinstance(head, ParallelLMHead):  # type: ignore[attr-defined]
                _replace(model, "lm_head", QuantLMHead(qm, vocab, op))
        return qm.weight.numel()
    fn = QuantLinearFn(matrices, op)
    module.use_weight_fn(fn)  # type: ignore[operator]
    return fn.nbytes


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)
