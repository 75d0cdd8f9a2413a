"""End-to-end fixtures. Starting a server costs seconds on 2 cores, so the plain default server is
shared by every module that only sends requests (session scope); tests that kill, stop or
reconfigure a server start their own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.service import Server, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "server")
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
