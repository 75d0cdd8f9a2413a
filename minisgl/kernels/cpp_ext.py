"""C++ CPU kernels built on first use with the system compiler (`torch.utils.cpp_extension.load_inline`,
cached under ~/.cache/torch_extensions). The sources are files under `kernels/csrc/` (package
data), concatenated in order into one translation unit: the shared vector math
(`avx512_math.h`) first, then the kernels. Each extension has a switch (a `KernelConfig` field, a
`--x/--no-x` flag) that turns it off; when it is off or the build fails (no compiler, no
headers), `load()` returns None and the callers keep their torch paths, after one warning naming
why."""

from __future__ import annotations

from importlib import resources
from typing import Any, Sequence

from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


def read_source(*names: str) -> str:
    """The files `names` of `kernels/csrc/`, concatenated."""
    folder = resources.files("minisgl.kernels") / "csrc"
    return "".join((folder / name).read_text(encoding="utf-8") for name in names)


class CppExtension:
    def __init__(self, name: str, sources: Sequence[str], functions: Sequence[str], flag: str, what: str,
                 cflags: Sequence[str] = ("-O3", "-march=native")) -> None:  # fmt: skip
        """`sources`: file names under `kernels/csrc/`; `flag`: the switch that turns it off (for the warning)."""
        self.name, self.sources, self.functions = name, tuple(sources), list(functions)
        self.flag, self.what = flag, what
        self.cflags = [*cflags, "-fopenmp"]
        self.module: Any = None
        self.failed = False

    def load(self) -> Any:
        """The built extension, or None (the build failed)."""
        if self.module is not None or self.failed:
            return self.module
        try:
            from torch.utils.cpp_extension import load_inline

            self.module = load_inline(
                name=self.name, cpp_sources=[read_source(*self.sources)], functions=self.functions,
                extra_cflags=self.cflags, extra_ldflags=["-fopenmp"], verbose=False,
            )  # fmt: skip
        except Exception as exc:  # no compiler, no headers: the torch path stays
            self.failed = True
            logger.warning("%s unavailable (%s: %s); using the torch path (%s hides this)",
                           self.what, type(exc).__name__, exc, self.flag)  # fmt: skip
        return self.module
