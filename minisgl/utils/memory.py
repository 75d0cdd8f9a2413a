"""Process memory helpers that need no torch (the tokenizer and detokenizer processes import none)."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Callable


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def trim_heap() -> bool:
    """Give malloc's free pages back to the system (every arena); False where there is no glibc.
    Loading a tokenizer parses a 3.5 MB tokenizer.json into temporaries that malloc keeps once
    freed: ~17 MiB of the detokenizer's RSS, ~25 MiB of the tokenizer's (SmolLM2)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
