"""Process memory helpers that need no torch (the tokenizer and detokenizer processes import none)."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Callable, Mapping


@cache
def _libc(function: str) -> Callable[..., int] | None:
    """glibc's `function` (malloc_trim, mallopt), or None (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function, None) if name else None
    except OSError:
        return None


def trim_heap() -> bool:
    """Give malloc's free pages back to the system (every arena); False where there is no glibc.
    Loading a tokenizer parses a 3.5 MB tokenizer.json into temporaries that malloc keeps once
    freed: ~17 MiB of the detokenizer's RSS, ~25 MiB of the tokenizer's (SmolLM2)."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)


def pin_mmap_threshold(threshold: int) -> bool:
    """Serve allocations of at least `threshold` bytes by mmap from now on, in this process; False
    where there is no glibc. glibc's threshold is dynamic: once a large mmapped block is freed (a
    prefill's activation, the logits) it rises to that block's size (up to 32 MiB), so later blocks
    that size come from the heap, which fragments and keeps them (the CPU scheduler's heap grew
    ~90 MiB while 10 streams decoded; trim_heap returns it only at idle). Setting it turns the
    dynamic adjustment off (and the trim threshold stays at twice the threshold)."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


# glibc's switch for transparent huge pages in malloc (read once, at process start, from the
# GLIBC_TUNABLES environment variable; glibc >= 2.35, ignored by older ones and other C libraries).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"


def huge_page_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a child process needs for malloc to back its large blocks with transparent
    huge pages: GLIBC_TUNABLES with glibc.malloc.hugetlb=1 added to what `environ` already sets
    (a hugetlb value given there wins). With the mmap threshold pinned (pin_mmap_threshold), each
    of a forward's large temporaries is a fresh mapping, which the kernel then fills 4 KiB page by
    page, one fault each; madvised huge, 2 MiB at a time: ~8 % of a W2 run's CPU time was page
    faults (perf), and a 32-prompt prefill took 18.9 s instead of 20.6-23.0 s (docs/performance.md).
    Only where the system's THP mode is `madvise` or `always`; a no-op under `never`."""
    current = environ.get("GLIBC_TUNABLES", "")
    entries = [e for e in current.split(":") if e]
    if any(e.split("=", 1)[0] == HUGE_PAGE_TUNABLE for e in entries):
        return {"GLIBC_TUNABLES": current}
    return {"GLIBC_TUNABLES": ":".join([*entries, f"{HUGE_PAGE_TUNABLE}=1"])}
