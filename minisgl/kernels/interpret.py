"""Run this package's Triton kernels on CPU through Triton's interpreter (CPU tests and CI).

`@triton.jit` chooses between compiling and interpreting when the decorator runs, reading
TRITON_INTERPRET then. Triton's own library functions (`tl.zeros`, `tl.cdiv`, ...) are decorated
when `triton.language` is first imported, so `use_triton_interpreter()` must run before anything
imports triton at all. It never runs on the GPU path.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

_PATCHED_MARK = "_minisgl_index_fix"


def use_triton_interpreter() -> bool:
    """Switch `@triton.jit` to the interpreter for everything imported from now on.

    Returns False (and changes nothing) when triton was already imported in compiled mode: its
    library functions are then compiled-only and interpreted kernels calling them would fail."""
    already_interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
    if "triton.language" in sys.modules and not already_interpreting:
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    _fix_scalar_index()
    return True


def _fix_scalar_index() -> None:
    """Let the interpreter use a runtime scalar as a loop bound under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and implements `tensor.__index__` (used by
    `range(lo, hi, step)` with runtime bounds) as `int(array)`, which numpy 2.4 rejects for arrays
    of ndim > 0 (triton-lang/triton#9171, fixed upstream after triton 3.6). We re-set `__index__`
    with `.item()`, which every numpy accepts, right after the interpreter's own per-launch patch.
    Pinning numpy < 2.4 would do as well; this keeps the environment unconstrained.
    """
    from triton.runtime import interpreter

    original: Callable[..., Any] | None = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, _PATCHED_MARK, False):
        return  # a Triton without this hook, or already fixed

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    setattr(patch_lang_tensor, _PATCHED_MARK, True)
    interpreter._patch_lang_tensor = patch_lang_tensor
