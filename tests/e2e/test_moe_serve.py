"""The real server on a tiny random-weight Qwen3-MoE answers through the openai client with the
offline engine's greedy text, alone and split over two tensor-parallel ranks (gloo).

The tiny model borrows the embedded SmolLM2 tokenizer (hence its 49152-token vocabulary): the
server tokenizes, applies the chat template and detokenizes like for any checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.service import Server, start_server, wait_idle
from tests.e2e.tp_models import check_openai_answers, copy_embedded_tokenizer, offline_answers
from tests.golden.test_moe_parity import make_tiny_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_moe")
    make_tiny_moe(path, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    copy_embedded_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def expected(moe_dir: Path) -> dict[str, Any]:
    return offline_answers(moe_dir)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory, moe_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "moe", "--model", str(moe_dir), "--num-pages", "64")
    yield srv
    srv.stop()


def _check_answers(server: Server, expected: dict[str, Any]) -> None:
    check_openai_answers(server.base_url, expected)
    wait_idle(server.port)


def test_moe_server_answers(moe_server: Server, expected: dict[str, Any]) -> None:
    _check_answers(moe_server, expected)


@pytest.mark.tp
def test_moe_server_tp2_answers(tmp_path_factory: pytest.TempPathFactory, moe_dir: Path,
                                expected: dict[str, Any]) -> None:  # fmt: skip
    """Each rank holds half of every expert's intermediate dimension; the all-reduce sums them."""
    srv = start_server(tmp_path_factory, "moe_tp2", "--model", str(moe_dir), "--tp", "2", "--num-pages", "64")
    try:
        _check_answers(srv, expected)
    finally:
        assert srv.stop() == 0
