"""End-to-end fixtures. Starting a server costs seconds on 2 cores, so the servers that only answer
requests are shared (session scope): the plain default one (tests/conftest.py: `server`, which
tests/conformance uses too), the keyed one and the small-context one below. Tests that kill,
stop or reconfigure a server start their own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.service import KEYED_ARGS, SMALL_CONTEXT_ARGS, Server, start_server


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`--api-key API_KEY --cors-origins CORS_ORIGIN --max-stored-responses 3` (tests/e2e/service.py)."""
    srv = start_server(tmp_path_factory, "keyed", *KEYED_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def small_context_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A 64-token context: a valid generated body costs at most a few dozen tokens."""
    srv = start_server(tmp_path_factory, "small_context", *SMALL_CONTEXT_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: Server) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def offline() -> Any:
    """The offline engine on the same weights: the reference for greedy outputs (the servers run
    `--dtype float32`: the dequantized fp32 model, tests/e2e/service.py)."""
    from minisgl import LLM

    return LLM(device="cpu", dtype="float32")
