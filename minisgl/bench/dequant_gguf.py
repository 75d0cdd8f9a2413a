"""Write an all-F32 copy of a GGUF file: every tensor dequantized with the `gguf` package, every
metadata field copied (only `general.file_type` changes, to ALL_F32), so llama.cpp runs the same
weights in fp32 as minisgl does on CPU.

    python -m minisgl.bench dequant-gguf SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

# Fields the writer derives itself (header counts, architecture) rather than copies.
_DERIVED = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _field_value(field: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    vtype = field.types[0]
    sub_type = field.types[1] if vtype == GGUFValueType.ARRAY else None
    return field.contents(), vtype, sub_type


def dequantize_file(src: Path, dst: Path) -> int:
    """Returns the number of tensors that were converted from a quantized or f16 type."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".partial")
    writer = GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name in _DERIVED:
            continue
        if name == "general.file_type":
            writer.add_key_value(name, int(LlamaFileType.ALL_F32), GGUFValueType.UINT32)
            continue
        value, vtype, sub_type = _field_value(field)
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    converted = 0
    for tensor in reader.tensors:
        if tensor.tensor_type != GGMLQuantizationType.F32:
            converted += 1
        # dequantize returns numpy order (outermost dim first), which is what add_tensor expects.
        weights = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if weights.shape != expected:
            weights = weights.reshape(expected)
        writer.add_tensor(tensor.name, weights, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return converted


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    converted = dequantize_file(src, dst)
    print(f"[dequant] {src.name} -> {dst} ({converted} tensors dequantized to F32)", file=sys.stderr)
    return 0
