"""End-to-end fixtures. Starting a server costs seconds on 2 cores, so the servers that only answer
requests are shared: the plain default one (tests/conftest.py: `server`, session scope, which
tests/conformance uses too), the keyed one and the small-context one below, all in the default
mode (`python -m minisgl --device cpu`: GGUF blocks kept quantized). Tests that kill,
stop or reconfigure a server start their own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.service import DEFAULT_ARGS, KEYED_ARGS, SMALL_CONTEXT_ARGS, Server, start_server

# Shared servers by fixture name. Their modules run back to back (pytest_collection_modifyitems) and
# each server stops after the last test that uses it (pytest_runtest_teardown), so no more servers
# are up at once than when every module started its own.
_SHARED_ARGS = {"keyed_server": KEYED_ARGS, "small_context_server": SMALL_CONTEXT_ARGS}
_shared: dict[str, Server] = {}
_last_user: dict[str, str] = {}


def _shared_server(name: str, tmp_path_factory: pytest.TempPathFactory) -> Server:
    if name not in _shared:
        _shared[name] = start_server(tmp_path_factory, name, *_SHARED_ARGS[name], base=DEFAULT_ARGS)
    return _shared[name]


def _shared_of(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    return next((name for name in _SHARED_ARGS if name in names), None)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of one shared server moved, whole and in their order, to where the first of
    them is."""
    module_group: dict[object, str] = {}
    for item in items:
        name = _shared_of(item)
        if name is not None:
            module_group.setdefault(item.path, name)
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.path in module_group:
            groups.setdefault(module_group[item.path], []).append(item)
    ordered: list[pytest.Item] = []
    for item in items:
        name = module_group.get(item.path)
        if name is None:
            ordered.append(item)
        elif item is groups[name][0]:
            ordered.extend(groups[name])
    items[:] = ordered


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        name = _shared_of(item)
        if name is not None:
            _last_user[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    for name, nodeid in _last_user.items():
        if item.nodeid == nodeid and name in _shared:
            _shared.pop(name).stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_servers() -> Iterator[None]:
    yield
    while _shared:
        _shared.popitem()[1].stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    """`--api-key API_KEY --cors-origins CORS_ORIGIN --max-stored-responses 3` (tests/e2e/service.py)."""
    return _shared_server("keyed_server", tmp_path_factory)


@pytest.fixture(scope="module")
def small_context_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A 64-token context: a valid generated body costs at most a few dozen tokens."""
    return _shared_server("small_context_server", tmp_path_factory)


@pytest.fixture(scope="session")
def client(server: Server) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def offline() -> Any:
    """The offline engine on the same weights as the servers a test starts itself (`--dtype
    float32`: the dequantized fp32 model, tests/e2e/service.py CPU_ARGS): their greedy reference."""
    from minisgl import LLM

    return LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def served_offline() -> Any:
    """The offline engine in the shared servers' mode (the default: GGUF blocks kept quantized,
    tests/e2e/service.py DEFAULT_ARGS): their greedy reference."""
    from minisgl import LLM

    return LLM(device="cpu")
