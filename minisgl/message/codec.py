"""msgpack codec for wire messages.

Each wire type is a dataclass registered with a small integer tag at definition time:

    @wire(tag=10)
    @dataclass
    class AbortMsg: ...

A registered object is packed as a msgpack ext value whose payload is `[tag, field0, field1, ...]`
in field order, so nested objects and lists of them round-trip. Decoding maps the tag to the class
through the registry filled at import time: nothing is looked up by name and nothing is pickled.
Field values must be msgpack-native (None, bool, int, float, str, bytes, list, dict) or registered
wire types. Tuples come back as lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")

_EXT_CODE = 1  # msgpack ext type code used for every registered dataclass

# tag -> (class, names of its init fields in order)
_BY_TAG: dict[int, tuple[type, tuple[str, ...]]] = {}
# class -> (tag, names of its init fields in order)
_BY_CLASS: dict[type, tuple[int, tuple[str, ...]]] = {}


def wire(tag: int) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a dataclass as a wire type under `tag` (unique, 0..65535)."""

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to be a wire type")
        if not 0 <= tag <= 0xFFFF:
            raise ValueError(f"wire tag {tag} out of range")
        if tag in _BY_TAG:
            raise ValueError(f"wire tag {tag} of {cls.__name__} is already used by {_BY_TAG[tag][0].__name__}")
        names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        _BY_TAG[tag] = (cls, names)
        _BY_CLASS[cls] = (tag, names)
        return cls

    return register


def registered_types() -> dict[int, type]:
    """Every registered wire type by tag (used by the round-trip tests)."""
    return {tag: cls for tag, (cls, _) in _BY_TAG.items()}


def _default(obj: Any) -> Any:
    entry = _BY_CLASS.get(type(obj))
    if entry is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered wire type")
    tag, names = entry
    payload = [tag]
    payload.extend(getattr(obj, name) for name in names)
    return msgpack.ExtType(_EXT_CODE, msgpack.packb(payload, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_CODE:
        raise ValueError(f"unknown msgpack ext code {code}")
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    entry = _BY_TAG.get(tag)
    if entry is None:
        raise ValueError(f"unknown wire tag {tag}")
    cls, names = entry
    if len(values) != len(names):
        raise ValueError(f"{cls.__name__}: expected {len(names)} fields, got {len(values)}")
    return cls(*values)


def encode(obj: Any) -> bytes:
    """Pack a registered wire object (or plain msgpack data containing them)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def _register_external() -> None:
    # Plain-data types defined below `message` that travel inside messages.
    from minisgl.core import SamplingParams

    wire(tag=1)(SamplingParams)


_register_external()
