"""GGUF file -> Hugging Face-style model directory (config.json, float32 safetensors, tokenizer).

The model code only knows HF directories, so a GGUF is converted once: config/tokenizer files are
rebuilt from the GGUF metadata, and (for the dequantized modes) every tensor is dequantized to
float32 and renamed to its HF name, with the llama.cpp-specific layout changes undone. The
quantized mode (`--weights gguf`) reads the blocks from the GGUF itself with the same plan
(`plan_tensors`): models/gguf_weights.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable

import numpy as np

from minisgl.models.errors import ModelSourceError
from minisgl.models.gguf_config import build_config, build_generation_config
from minisgl.models.gguf_reader import ARCHS, check_tensor_type, dequantize_tensor, numpy_shape, open_gguf, read_metadata
from minisgl.models.gguf_tokenizer import write_tokenizer_files
from minisgl.utils.logging import get_logger

if TYPE_CHECKING:
    from gguf import GGUFReader

    from minisgl.models.gguf_table import GGUFTable
    from gguf.gguf_reader import ReaderTensor

logger = get_logger(__name__)

# Above this many bytes the safetensors output is split into shards, like HF checkpoints.
MAX_SHARD_BYTES = 4 * 1024**3


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: where it comes from and what to do to it."""

    hf_name: str
    shape: tuple[int, ...]
    source: ReaderTensor
    expert: int | None = None  # index into a merged [n_expert, ...] GGUF tensor
    unpermute_heads: int | None = None  # undo llama.cpp's rope row permutation with this head count


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores each head's rows as interleaved (even, odd) pairs for its rotary layout;
    # HF keeps the two halves contiguous. Rows are [head, half, pair] in GGUF -> [head, pair, half].
    # A pure row permutation: it applies as well to rows of quantized blocks ([n, row_bytes]).
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def plan_tensors(reader: GGUFReader, arch: str, n_head: int, n_kv_head: int) -> list[TensorPlan]:
    spec = ARCHS[arch]
    plans: list[TensorPlan] = []
    for tensor in reader.tensors:
        check_tensor_type(tensor)
        shape = numpy_shape(tensor)
        if tensor.name in _GLOBAL_NAMES:
            plans.append(TensorPlan(_GLOBAL_NAMES[tensor.name], shape, tensor))
            continue
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling by _llama3_rope_scaling
        match = _LAYER_RE.fullmatch(tensor.name)
        if match is None:
            raise ModelSourceError(f"GGUF tensor {tensor.name} has no Hugging Face equivalent for arch {arch}")
        layer, part, kind = match.groups()
        prefix = f"model.layers.{layer}"
        if part in _EXPERT_NAMES:
            for expert in range(shape[0]):
                name = f"{prefix}.mlp.experts.{expert}.{_EXPERT_NAMES[part]}.{kind}"
                plans.append(TensorPlan(name, shape[1:], tensor, expert=expert))
            continue
        if part not in _LAYER_NAMES:
            raise ModelSourceError(f"GGUF tensor {tensor.name} has no Hugging Face equivalent for arch {arch}")
        heads = None
        if spec.permute_qk and part in ("attn_q", "attn_k"):
            heads = n_head if part == "attn_q" else n_kv_head
        plans.append(TensorPlan(f"{prefix}.{_LAYER_NAMES[part]}.{kind}", shape, tensor, unpermute_heads=heads))
    return plans


def materialize(plans: Iterable[TensorPlan]) -> Iterable[tuple[TensorPlan, np.ndarray]]:
    from tqdm import tqdm

    cached: tuple[str, np.ndarray] | None = None  # a merged expert tensor feeds several outputs
    for plan in tqdm(list(plans), desc="dequantizing GGUF", unit="tensor", disable=None):
        if cached is None or cached[0] != plan.source.name:
            cached = (plan.source.name, dequantize_tensor(plan.source))
        values = cached[1] if plan.expert is None else cached[1][plan.expert]
        if plan.unpermute_heads is not None:
            values = unpermute_rows(values, plan.unpermute_heads)
        assert values.shape == plan.shape, (plan.hf_name, values.shape, plan.shape)
        yield plan, values


def _write_shard(path: Path, plans: list[TensorPlan], values: Iterable[tuple[TensorPlan, np.ndarray]]) -> None:
    """Stream a float32 safetensors file so peak memory is one tensor, not the whole model."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for plan in plans:
        nbytes = 4 * math.prod(plan.shape)
        header[plan.hf_name] = {"dtype": "F32", "shape": list(plan.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data section 8-byte aligned
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        for _, array in values:
            _write_array(out, array)


def _write_array(out: BinaryIO, array: np.ndarray) -> None:
    out.write(np.ascontiguousarray(array, dtype="<f4").data)


def write_weights(out_dir: Path, plans: list[TensorPlan]) -> None:
    shards: list[list[TensorPlan]] = [[]]
    shard_bytes = 0
    for plan in plans:
        nbytes = 4 * math.prod(plan.shape)
        if shards[-1] and shard_bytes + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(plan)
        shard_bytes += nbytes
    stream = iter(materialize(plans))
    if len(shards) == 1:
        _write_shard(out_dir / "model.safetensors", plans, stream)
        return
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out_dir / file_name, shard, (next(stream) for _ in shard))
        weight_map.update({plan.hf_name: file_name for plan in shard})
    total = sum(4 * math.prod(plan.shape) for plan in plans)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def gguf_arch(reader: GGUFReader | GGUFTable, gguf_path: Path) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHS:
        raise ModelSourceError(
            f"GGUF architecture {arch!r} in {gguf_path.name} is not supported; supported: {', '.join(ARCHS)}"
        )
    return str(arch)


def convert_gguf(gguf_path: Path, out_dir: Path, *, weights: bool = True, meta_done: bool = False) -> None:
    """Write config.json, generation_config.json and tokenizer files into out_dir, and with
    `weights` the float32 safetensors (without: the quantized path reads the GGUF's blocks
    itself, models/gguf_weights.py). `meta_done`: out_dir has the first three already."""
    reader = open_gguf(gguf_path)
    arch = gguf_arch(reader, gguf_path)
    meta = read_metadata(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = build_config(meta, ARCHS[arch], arch, tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not meta_done:
        # Tokenizer first: it fails on unknown tokenizer models before the slow weight pass.
        write_tokenizer_files(meta, out_dir, config["max_position_embeddings"], gguf_path)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        (out_dir / "generation_config.json").write_text(json.dumps(build_generation_config(meta), indent=2))
    if weights:
        plans = plan_tensors(reader, arch, config["num_attention_heads"], config["num_key_value_heads"])
        logger.info("dequantizing %d GGUF tensors of %s to float32", len(reader.tensors), gguf_path.name)
        write_weights(out_dir, plans)
