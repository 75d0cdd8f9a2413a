"""A GGUF file's tensor table (names, types, shapes, data as numpy memmaps) and scalar metadata,
parsed directly: what the quantized load (gguf_weights.py) needs at every start, in ~0.1 s where
`gguf.GGUFReader` takes seconds (it builds numpy objects for every token of the vocabulary).

The tensors quack like `gguf.gguf_reader.ReaderTensor` for what gguf.py and gguf_reader.py read
(`name`, `tensor_type`, `shape` in ggml order, `data`), so `plan_tensors` and
`dequantize_tensor` take them unchanged. Format: github.com/ggml-org/ggml docs/gguf.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.models.errors import ModelSourceError

_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_ITEM_TYPES: dict[str, Any] = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                               "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class Scalar:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class TableTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml order (fastest dimension first), like ReaderTensor.shape
    data: np.ndarray  # read-only memmap: [..., row_bytes] uint8 for block types, else the values


class GGUFTable:
    """`tensors` and `fields` (scalar metadata only: arrays such as the vocabulary are skipped)."""

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            self._mm = np.memmap(path, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelSourceError(f"cannot read GGUF file {path}: {exc}") from exc
        self._buf = memoryview(self._mm)
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ModelSourceError(f"cannot read GGUF file {path}: not a GGUF file")
        self._pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3):
            raise ModelSourceError(f"cannot read GGUF file {path}: GGUF version {version} is not supported")
        self.fields: dict[str, Scalar] = {}
        try:
            for _ in range(n_kv):
                key = self._string()
                value = self._value(self._read("<I"))
                if value is not None:
                    self.fields[key] = Scalar(value)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                dims = [self._read("<Q") for _ in range(self._read("<I"))]
                infos.append((name, dims, self._read("<I"), self._read("<Q")))
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ModelSourceError(f"cannot read GGUF file {path}: truncated or corrupt header ({exc})") from exc
        alignment = int(self.fields.get("general.alignment", Scalar(32)).value)
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[TableTensor] = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelSourceError(f"GGUF tensor {name} has unknown type id {type_id}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            np_dims = tuple(reversed(dims))
            item = _ITEM_TYPES.get(qtype.name)
            if item is None:  # block types: rows of bytes
                np_dims = (*np_dims[:-1], np_dims[-1] // block * type_size)
                item = np.uint8
            count = int(np.prod(np_dims))
            begin = start + offset
            end = begin + count * np.dtype(item).itemsize
            if end > len(self._mm):
                raise ModelSourceError(f"cannot read GGUF file {path}: tensor {name} runs past the end of the file")
            data = self._mm[begin:end].view(item).reshape(np_dims)
            self.tensors.append(TableTensor(name, qtype, np.array(dims, dtype=np.uint64), data))

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        """A scalar or string; arrays are skipped (None)."""
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise struct.error(f"unknown metadata value type {kind}")
        item, count = self._read("<I"), self._read("<Q")
        if item in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[item])
        else:
            for _ in range(count):
                self._value(item)
        return None
