"""The real server on a tiny random-weight Qwen3-MoE answers through the openai client with the
offline engine's greedy text, alone and split over two tensor-parallel ranks (gloo).

The tiny model borrows the embedded SmolLM2 tokenizer (hence its 49152-token vocabulary): the
server tokenizes, applies the chat template and detokenizes like for any checkpoint."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minisgl.core import SamplingParams
from tests.e2e.service import Server, start_server, wait_idle
from tests.golden.test_moe_parity import make_tiny_moe

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.models.source import resolve_model_dir

    path = tmp_path_factory.mktemp("tiny_moe")
    make_tiny_moe(path, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    tokenizer_dir = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def expected(moe_dir: Path) -> dict[str, Any]:
    from minisgl import LLM

    llm = LLM(str(moe_dir), device="cpu", num_pages=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {
        "completions": [r["text"] for r in llm.generate(PROMPTS, params, use_tqdm=False)],
        "chat": llm.chat(CHAT, params, use_tqdm=False)[0]["text"],
    }


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory, moe_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "moe", "--model", str(moe_dir), "--num-pages", "64")
    yield srv
    srv.stop()


def _client(server: Server) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=180)


def _check_answers(server: Server, expected: dict[str, Any]) -> None:
    client = _client(server)
    completion = client.completions.create(model="m", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    texts = [choice.text for choice in sorted(completion.choices, key=lambda c: c.index)]
    assert texts == expected["completions"]
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == expected["chat"]
    wait_idle(server.port)


def test_moe_server_answers(moe_server: Server, expected: dict[str, Any]) -> None:
    assert any(expected["completions"]) and expected["chat"]
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
