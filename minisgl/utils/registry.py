"""A tiny name -> entry registry shared by every pluggable part (prefix caches, attention
backends, samplers, communicators).

Entries are usually *creator functions* that import their implementation lazily, so
registering a backend costs nothing until it is chosen. `meta` carries facts a selector needs
without building the entry (e.g. `platforms=("cuda",)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        # `kind` only names the registry in error messages ("unknown prefix cache 'x'").
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        """Decorator: `@REG.register("radix", platforms=("cpu", "cuda"))` on a creator."""

        def decorate(entry: T) -> T:
            if name in self._entries:
                # Two modules claiming one name is a packaging bug; fail at import time.
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            self._meta[name] = dict(meta)
            return entry

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            # Names usually come from the CLI or a config, so this is a user error.
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def meta(self, name: str) -> dict[str, Any]:
        self.get(name)  # same error for an unknown name
        return dict(self._meta[name])

    def __contains__(self, name: object) -> bool:
        return name in self._entries
