"""The code base's shape (issue 21): file sizes, the import graph, scripts/, env-var reads.

The import graph is read statically with `ast` (nothing is imported). Three kinds of import:
module-level, under `if TYPE_CHECKING:` (annotations only), and inside a function (lazy).
- Layers (shared/STYLE.md section 1): no import of any kind from a lower package into a higher
  one: a `TYPE_CHECKING` import does not hide an upward dependency.
- Cycles: the module-level imports (`TYPE_CHECKING` ones included) between modules of minisgl
  form no cycle.
- Lazy imports load something below: a function-level import from A to B is allowed only when B
  does not import A back through module-level imports (a lazy import must not be the back edge
  that hides a cycle).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minisgl"
MAX_LINES = 500
MAX_SCRIPTS = 6

# shared/STYLE.md section 1, top to bottom; one rank per line of the diagram. `bench` sits at the
# top with the server; the package root (`minisgl/__init__.py`, `__main__.py`) and the `--shell`
# front end are front ends too.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("server", "llm", "bench", "shell", "__init__", "__main__"),
    ("tokenizer",),
    ("scheduler",),
    ("engine",),
    ("models",),
    ("layers", "attention", "kvcache", "lora"),
    ("distributed",),
    ("kernels",),
    ("core", "message"),
    ("platform", "env", "utils"),
)
RANK = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}


class Import(NamedTuple):
    source: str  # importing module, dotted
    target: str  # imported module of minisgl, dotted
    kind: str  # "module", "type_checking" or "function"
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of minisgl."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def add(name: str, kind: str, line: int) -> None:
        target = _resolve(name, modules)
        if target is not None and target != module:
            found.append(Import(module, target, kind, line))

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, kind, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports pkg.submodule
                add(f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix, kind, node.lineno)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type_checking" if kind == "module" else kind)
            for child in node.orelse:
                visit(child, kind)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in ast.iter_child_nodes(node):
                visit(child, "function")
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, kind)

    visit(tree, "module")
    return found


def _all_imports() -> list[Import]:
    modules = _modules()
    found = [imp for module, path in modules.items() for imp in _imports_of(module, path, modules)]
    return list(dict.fromkeys(found))  # `from x import a, b` once


def _package(module: str) -> str:
    """The layer name of a dotted module: `minisgl.models.gguf` -> `models`, `minisgl` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return out


# --------------------------------------------------------------------------- the checker itself


def test_import_reader_sees_every_kind(tmp_path: Path) -> None:
    """The ast reader classifies module-level, TYPE_CHECKING and function-level imports, and
    resolves relative imports and `from pkg import submodule`."""
    pkg = tmp_path / "minisgl" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "minisgl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    source = pkg / "high.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport minisgl.sub.low\nfrom . import low\n"
        "if TYPE_CHECKING:\n    from minisgl.sub.low import X\n"
        "def f():\n    from .low import X\n    return X\n"
    )
    modules = {"minisgl": tmp_path / "minisgl" / "__init__.py", "minisgl.sub": pkg / "__init__.py",
               "minisgl.sub.low": pkg / "low.py", "minisgl.sub.high": source}  # fmt: skip
    found = [(imp.target, imp.kind) for imp in _imports_of("minisgl.sub.high", source, modules)]
    assert found == [("minisgl.sub.low", "module"), ("minisgl.sub.low", "module"),
                     ("minisgl.sub.low", "type_checking"), ("minisgl.sub.low", "function")]  # fmt: skip
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_has_a_layer() -> None:
    packages = {_package(module) for module in _modules()}
    assert packages - RANK.keys() == set(), "a new package of minisgl needs a place in LAYERS (and STYLE.md)"


# --------------------------------------------------------------------------- the code base


def test_no_file_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files in minisgl/ over {MAX_LINES} lines: {long}"


def test_no_upward_imports() -> None:
    upward = [
        f"{imp.source}:{imp.line} imports {imp.target} ({imp.kind})"
        for imp in _all_imports()
        if RANK[_package(imp.source)] < RANK[_package(imp.target)]
    ]
    assert upward == [], "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_no_module_level_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        if imp.kind != "function":
            graph.setdefault(imp.source, set()).add(imp.target)
    assert _cycles(graph) == [], "module-level import cycles"


def test_lazy_imports_point_downward() -> None:
    module_graph: dict[str, set[str]] = {}
    imports = _all_imports()
    for imp in imports:
        if imp.kind != "function":
            module_graph.setdefault(imp.source, set()).add(imp.target)
    back = [
        f"{imp.source}:{imp.line} lazily imports {imp.target}, which imports {imp.source} back"
        for imp in imports
        if imp.kind == "function" and imp.source in _reach(module_graph, imp.target)
    ]
    assert back == [], "function-level imports that close a cycle:\n" + "\n".join(back)


def test_offline_llm_does_not_import_zmq() -> None:
    """The offline API runs the request path in-process: no sockets, so no zmq (the scheduler's
    builder lives in scheduler/build.py, the request entry in tokenizer/request.py)."""
    code = "import sys, minisgl.llm; print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith(('zmq.', 'minisgl.utils.zmq'))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    assert out.strip() == "[]", f"import minisgl.llm loads {out.strip()}"


def test_scripts_holds_only_what_users_and_ci_run() -> None:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert len(files) <= MAX_SCRIPTS, f"scripts/ holds {len(files)} files (at most {MAX_SCRIPTS}): {files}"


def test_env_vars_read_only_in_env_py() -> None:
    pattern = re.compile(r"MINISGL_")
    stray = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != PACKAGE / "env.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert stray == [], "MINISGL_ outside minisgl/env.py:\n" + "\n".join(stray)


def _replaced_attributes(source: str) -> list[int]:
    """Lines that assign to an attribute of something imported from minisgl (`Engine.launch = f`,
    `engine_mod.LaunchedStep.result = f`, tuple targets too) or call `setattr`."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name.startswith("minisgl")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minisgl"):
            names |= {alias.asname or alias.name for alias in node.names}

    def from_minisgl(value: ast.expr) -> bool:
        while isinstance(value, ast.Attribute):
            value = value.value
        return isinstance(value, ast.Name) and value.id in names

    for _ in range(3):  # local aliases: `Engine = engine_mod.Engine`, `A, B = mod.A, mod.B`
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                tuples = isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                pairs = zip(target.elts, value.elts) if tuples else [(target, value)]
                names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and from_minisgl(v)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            targets = []
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                base = item
                while isinstance(base, ast.Attribute):
                    base = base.value
                if item is not base and isinstance(base, ast.Name) and base.id in names:
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            lines.append(node.lineno)
    return sorted(set(lines))


def test_replaced_attribute_reader() -> None:
    source = (
        "import minisgl.engine.engine as engine_mod\nfrom minisgl.scheduler.scheduler import Scheduler\n"
        "import triton.knobs\nclass Local: pass\n"
        "engine_mod.LaunchedStep.result = None\nScheduler.step, Scheduler._plan = 1, 2\n"
        "triton.knobs.runtime.jit_cache_hook = None\nLocal.x = 1\nsetattr(Local, 'y', 2)\nvalue = Scheduler\n"
    )
    assert _replaced_attributes(source) == [5, 6, 9]


def test_no_timing_code_replaces_methods() -> None:
    """Profilers and tools measure through hooks (cProfile, torch.profiler, Triton's JIT hook, the
    scheduler's public calls), never by assigning over an attribute of a minisgl class or module."""
    files = sorted([*(ROOT / "tools").glob("*.py"), *(PACKAGE / "bench").glob("*.py")])
    replaced = [f"{path.relative_to(ROOT)}:{line}" for path in files for line in _replaced_attributes(path.read_text())]
    assert replaced == [], "attributes of minisgl replaced at run time:\n" + "\n".join(replaced)


@pytest.mark.parametrize("tool", sorted(p.name for p in (ROOT / "tools").glob("*.py")) if (ROOT / "tools").is_dir() else [])
def test_tools_say_what_they_measured(tool: str) -> None:
    """Each research tool (outside the package) opens with a docstring naming where its findings
    are kept."""
    text = (ROOT / "tools" / tool).read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert doc, f"tools/{tool} has no header docstring"
    if not tool.startswith("_"):
        assert "docs/performance.md" in doc, f"tools/{tool}: the header should say where its findings are"
