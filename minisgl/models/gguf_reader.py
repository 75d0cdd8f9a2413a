"""Reading GGUF files: the supported tensor types and architectures, metadata, dequantization.

The lowest piece of the GGUF support: `gguf.py` (conversion), `gguf_config.py` and
`gguf_tokenizer.py` build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minisgl.models.errors import ModelSourceError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from gguf.gguf_reader import ReaderTensor

# Types we accept. gguf.quants can also dequantize the IQ*/TQ* families, but those have no
# round-trip coverage in our tests, so we refuse them instead of silently trusting them.
SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


@dataclass(frozen=True)
class ArchSpec:
    hf_arch: str
    model_type: str
    permute_qk: bool  # llama.cpp's convert script permutes q/k rows only for the llama family


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", permute_qk=False),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", permute_qk=False),
    "qwen3moe": ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", permute_qk=False),
}


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def open_gguf(path: Path) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelSourceError(f"cannot read GGUF file {path}: {exc}") from exc


def numpy_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ggml `ne`); numpy/torch are slowest-first.
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))


def check_tensor_type(tensor: ReaderTensor) -> None:
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
        raise ModelSourceError(
            f"GGUF tensor {tensor.name} has unsupported type {type_name}; "
            f"supported types: {', '.join(SUPPORTED_TYPES)} (re-quantize the model to one of them)"
        )


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in numpy (slowest-first) order."""
    from gguf.quants import dequantize

    check_tensor_type(tensor)
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return values.reshape(numpy_shape(tensor))
