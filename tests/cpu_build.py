"""The C++ CPU libraries the kernel tests run, built (or loaded from their cache) once per module.
A failed build fails the test loudly instead of skipping it: the suite's machines have a C++
compiler (the README's setup), so a failure here is a broken source, not a missing toolchain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def build(load: Callable[..., T], **kwargs: Any) -> T:
    try:
        return load(**kwargs)
    except RuntimeError as exc:
        pytest.fail(f"building the C++ CPU kernels failed (needs a C++ compiler, g++ or clang++): {exc}", pytrace=False)
