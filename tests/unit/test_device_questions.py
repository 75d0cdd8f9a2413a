"""Device questions go to the platform (shared/STYLE.md section 6): outside `platform/`,
`engine/graph.py` (CUDA graphs) and `kernels/` (Triton launches), no module of minisgl/ asks torch
about CUDA itself; and `MINISGL_` environment variables are named only in `env.py`."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minisgl"
ALLOWED = ("platform/", "kernels/", "engine/graph.py")
STRAY = re.compile(r"torch\.cuda|\.is_cuda\b|device\.type\s*[!=]=\s*[\"']cuda[\"']")


def _sources() -> list[tuple[str, str]]:
    return [(path.relative_to(PACKAGE).as_posix(), path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]


def test_pattern_catches_the_forms() -> None:
    for line in ("torch.cuda.synchronize()", "if x.is_cuda:", 'device.type == "cuda"', "t.device.type != 'cuda'"):
        assert STRAY.search(line), line
    assert not STRAY.search('device.type == "cpu"')


def test_no_stray_cuda_questions() -> None:
    strays = [
        f"{name}:{number}: {line.strip()}"
        for name, text in _sources()
        if not name.startswith(ALLOWED)
        for number, line in enumerate(text.splitlines(), 1)
        if STRAY.search(line)
    ]
    assert len(_sources()) > 50 and not strays, "\n".join(strays)


def test_environment_names_only_in_env() -> None:
    named = [f"{name}:{n}" for name, text in _sources() if name != "env.py"
             for n, line in enumerate(text.splitlines(), 1) if "MINISGL_" in line]  # fmt: skip
    assert not named, named
