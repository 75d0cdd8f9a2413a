"""`POST /v1/embeddings` on the real server, driven by the official openai SDK: float and base64
vectors equal transformers' (last token, normalized) on a tiny random Qwen3 embedding checkpoint,
list and token-id inputs, Matryoshka dimensions, usage, errors in OpenAI's shape, the API key;
and each kind of server refusing the other kind's requests with a clear 400."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.service import Server, post_json, start_server
from tests.e2e.tp_models import copy_embedded_tokenizer
from tests.embed_models import make_tiny_embedder, reference_embeddings

openai = pytest.importorskip("openai")

KEY = "embed-secret"
TOL = 1e-5
TEXTS = ["The capital of France is Paris.", "Hello", "A decoder embeds a text by its last token's state."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_embedder_serve")
    make_tiny_embedder(path, vocab_size=49152)
    copy_embedded_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "embed", "--model", str(model_dir), "--num-pages", "64",
                       "--page-size", "4", "--api-key", KEY)  # fmt: skip
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def embed_client(embed_server: Server) -> Any:
    return openai.OpenAI(base_url=f"{embed_server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _reference(model_dir: Path, texts: list[str], dimensions: int | None = None) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return reference_embeddings(model_dir, [tokenizer.encode(t) for t in texts], dimensions)


def _close(got: list[list[float]], refs: list[torch.Tensor]) -> None:
    assert len(got) == len(refs)
    for vec, ref in zip(got, refs):
        assert len(vec) == ref.numel()
        assert (torch.tensor(vec) - ref).abs().max().item() < TOL


def _idle(server: Server) -> None:
    """Nothing running or live, every page free or evictable (the keyed stats route)."""
    deadline = time.monotonic() + 30
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/internal/stats", headers={"Authorization": f"Bearer {KEY}"})
        stats = json.loads(conn.getresponse().read())
        conn.close()
        if stats["running"] == stats["waiting"] == stats["live_requests"] == 0 and \
                stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]:  # fmt: skip
            return
        time.sleep(0.2)
    raise AssertionError(f"not idle: {stats}")


def test_float_and_base64(embed_client: Any, embed_server: Server, model_dir: Path) -> None:
    refs = _reference(model_dir, TEXTS)
    as_float = embed_client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert as_float.object == "list" and as_float.model == "tiny"
    assert [d.index for d in as_float.data] == [0, 1, 2] and all(d.object == "embedding" for d in as_float.data)
    _close([d.embedding for d in as_float.data], refs)
    as_base64 = embed_client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 and decodes
    _close([d.embedding for d in as_base64.data], refs)  # (prefix-cache hits now: equal within rounding)
    raw = embed_client.embeddings.with_raw_response.create(model="tiny", input="Hello", encoding_format="base64")
    assert isinstance(json.loads(raw.text)["data"][0]["embedding"], str)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tokenizer.encode(t)) for t in TEXTS]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(lengths)
    _idle(embed_server)


def test_token_inputs_and_dimensions(embed_client: Any, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(model_dir).encode(t) for t in TEXTS]
    one = embed_client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    many = embed_client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    _close([one.data[0].embedding], reference_embeddings(model_dir, ids[:1]))
    _close([d.embedding for d in many.data], reference_embeddings(model_dir, ids))
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)
    short = embed_client.embeddings.create(model="tiny", input=TEXTS, dimensions=16, encoding_format="float")
    _close([d.embedding for d in short.data], _reference(model_dir, TEXTS, dimensions=16))


def test_errors_in_openai_shape(embed_client: Any, embed_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        embed_client.embeddings.create(model="tiny", input=TEXTS, dimensions=65)
    assert info.value.body["param"] == "dimensions" and "between 1 and 64" in info.value.body["message"]
    for body, param in (({"input": []}, "input"), ({"input": ["a", ""]}, "input"), ({"input": [[]]}, "input"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": "a", "extra_body": {"pooling": "mean"}}, "pooling"),
                        ({"input": [1, 99999999]}, "input")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            embed_client.embeddings.create(model="tiny", **body)
        assert info.value.status_code == 400 and info.value.body["param"] == param, body
        assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        embed_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        embed_client.completions.create(model="tiny", prompt="hi", stream=True)
    _idle(embed_server)


def test_api_key(embed_server: Server) -> None:
    wrong = openai.OpenAI(base_url=f"{embed_server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model="tiny", input="hi")
    status, body = post_json(embed_server.port, "/v1/embeddings", {"input": "hi"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_generation_server_refuses_embeddings(client: Any) -> None:
    """The shared default server (SmolLM2, a causal LM) serves no embeddings."""
    with pytest.raises(openai.BadRequestError, match="text-generation model"):
        client.embeddings.create(model="x", input="hi")
