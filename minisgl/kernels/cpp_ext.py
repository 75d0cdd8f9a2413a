"""C++ CPU kernels built on first use with the system compiler (`torch.utils.cpp_extension.load_inline`,
cached under ~/.cache/torch_extensions), each with an environment switch (read in `env.py`) that
turns it off. When the switch is off or the build fails (no compiler, no headers), `load()`
returns None and the callers keep their torch paths, after one warning naming why."""

from __future__ import annotations

from typing import Any, Sequence

from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


class CppExtension:
    def __init__(self, name: str, source: str, functions: Sequence[str], enabled: bool, switch: str, what: str,
                 cflags: Sequence[str] = ("-O3", "-march=native")) -> None:  # fmt: skip
        """`enabled`: the value of the environment switch named `switch` (for the warning)."""
        self.name, self.source, self.functions = name, source, list(functions)
        self.switch, self.what = switch, what
        self.cflags = [*cflags, "-fopenmp"]
        self.module: Any = None
        self.failed = not enabled

    def load(self) -> Any:
        """The built extension, or None (turned off by its switch, or the build failed)."""
        if self.module is not None or self.failed:
            return self.module
        try:
            from torch.utils.cpp_extension import load_inline

            self.module = load_inline(
                name=self.name, cpp_sources=[self.source], functions=self.functions,
                extra_cflags=self.cflags, extra_ldflags=["-fopenmp"], verbose=False,
            )  # fmt: skip
        except Exception as exc:  # no compiler, no headers: the torch path stays
            self.failed = True
            logger.warning("%s unavailable (%s: %s); using the torch path (%s=0 hides this)",
                           self.what, type(exc).__name__, exc, self.switch)  # fmt: skip
        return self.module
