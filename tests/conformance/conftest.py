"""The conformance tier: request shapes the peers' own OpenAI-server suites send (vLLM
`tests/entrypoints/openai/`, SGLang `test/srt/openai_server/`, llama.cpp `tools/server/tests/unit/`),
against the real `python -m minisgl --device cpu` (embedded model), through the official `openai`
client and raw HTTP. No assertion depends on the model's words: outputs are pinned by logit_bias,
structured output or stop conditions, or compared with each other (stream vs non-stream).

One default server serves the whole tier (tests/conftest.py: `server`, session scope, shared with
tests/e2e); test_context_end.py starts a second one with a short context."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.service import Server, post_json, sse_lines


@pytest.fixture(scope="session")
def client(server: Server) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=600)


@pytest.fixture(scope="session")
def token(server: Server) -> tuple[int, str]:
    """A token id whose text is plain visible ASCII: forced by logit_bias, it pins the output."""
    status, body = post_json(server.port, "/tokenize", {"prompt": "hello", "add_special_tokens": False})
    assert status == 200, body
    tid = body["tokens"][0]
    status, back = post_json(server.port, "/detokenize", {"tokens": [tid]})
    assert status == 200 and len(back["prompt"].strip()) >= 2, back
    return tid, back["prompt"]


def stream_events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed response, checked to end with `data: [DONE]`."""
    lines = sse_lines(server.port, path, {**body, "stream": True})
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines[-3:]
    return [json.loads(line[6:]) for line in lines[:-1]]


def error_of(server: Server, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    """(status, error object) of a refused request; the body is OpenAI's error shape."""
    status, data = post_json(server.port, path, body)
    assert set(data) == {"error"} and isinstance(data["error"]["message"], str), data
    return status, data["error"]
