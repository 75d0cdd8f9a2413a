"""Multi-LoRA through the real server and the openai client: a request's `model` picks the
adapter (answers equal to the offline engine's, which tests/golden/test_lora_parity.py holds to
PEFT), /v1/models lists adapters with their parent, adapters load and unload at run time with
vLLM's routes and errors, and unloading an adapter while its requests stream fails none of them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.service import Server, get_json, request, start_server
from tests.e2e.tp_models import make_served_model, openai_client
from tests.lora_adapters import ALL_TARGETS, make_adapter

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
LONG = 300  # tokens of the requests that stream while their adapter is unloaded


def post_json(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """vLLM answers a load / unload with plain text, an error with OpenAI's JSON object."""
    import json

    status, data = request(port, "POST", path, json.dumps(body).encode(), timeout=120)
    return status, data.decode() if status == 200 else json.loads(data)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers as tf

    root = tmp_path_factory.mktemp("lora_serve")
    base = make_served_model("llama", root / "base")
    hf = tf.AutoModelForCausalLM.from_pretrained(str(base)).eval()
    make_adapter(hf, root / "alpha", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    make_adapter(hf, root / "beta", rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2)
    make_adapter(hf, root / "huge", rank=16, alpha=16, targets=["q_proj"], seed=3)
    return {"base": base, "alpha": root / "alpha", "beta": root / "beta", "huge": root / "huge"}


@pytest.fixture(scope="module")
def expected(lora_dirs: dict[str, Path]) -> dict[str | None, list[str]]:
    """Greedy completions of the offline engine, per adapter (None: the base model): the short
    answers and the long one of every adapter in one mixed batch (equal to each request alone:
    tests/golden/test_lora_parity.py), so the 300-token references decode side by side."""
    from minisgl import LLM, SamplingParams

    llm = LLM(str(lora_dirs["base"]), device="cpu", num_pages=128, max_loras=2, max_lora_rank=8,
              lora_modules={"alpha": str(lora_dirs["alpha"]), "beta": str(lora_dirs["beta"])})  # fmt: skip
    names = (None, "alpha", "beta")
    short = SamplingParams(temperature=0, max_tokens=8)
    long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    prompts = [*PROMPTS, PROMPTS[0]] * len(names)
    params = [short] * len(PROMPTS) + [long]
    loras = [name for name in names for _ in range(len(PROMPTS) + 1)]
    texts = [r.outputs[0].text for r in llm.generate(prompts, params * len(names), use_tqdm=False, lora=loras)]
    out: dict[str | None, list[str]] = {}
    for i, name in enumerate(names):
        mine = texts[i * (len(PROMPTS) + 1) : (i + 1) * (len(PROMPTS) + 1)]
        out[name] = mine[: len(PROMPTS)]
        out[f"long-{name}"] = mine[len(PROMPTS) :]  # type: ignore[index]
    assert out["alpha"] != out[None] and out["beta"] != out[None], "the adapters must change the answers"
    return out


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, lora_dirs: dict[str, Path]) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "lora", "--model", str(lora_dirs["base"]), "--num-pages", "128",
                       "--served-model-name", "base", "--lora-modules", f"alpha={lora_dirs['alpha']}",
                       "--max-loras", "2", "--max-lora-rank", "8")  # fmt: skip
    yield srv
    srv.stop()


def _complete(client: Any, model: str) -> list[str]:
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_model_field_picks_the_adapter(lora_server: Server, lora_dirs: dict[str, Path], expected: Any) -> None:
    client = openai_client(lora_server.base_url)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "alpha"}
    assert cards["alpha"].parent == "base" and cards["alpha"].root == str(lora_dirs["alpha"])
    assert client.models.retrieve("alpha").parent == "base"
    assert _complete(client, "alpha") == expected["alpha"]
    assert _complete(client, "base") == expected[None]
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0)  # fmt: skip
    base_chat = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, temperature=0)  # fmt: skip
    assert chat.model == "alpha" and chat.choices[0].message.content != base_chat.choices[0].message.content


def test_bad_input_is_refused_in_openai_shape(lora_server: Server, lora_dirs: dict[str, Path]) -> None:
    import openai

    client = openai_client(lora_server.base_url)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    port = lora_server.port
    status, body = post_json(port, "/v1/load_lora_adapter", {"lora_name": "huge", "lora_path": str(lora_dirs["huge"])})
    assert status == 400 and "greater than max_lora_rank 8" in body["error"]["message"]
    status, body = post_json(port, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(lora_dirs["alpha"])})
    assert status == 400 and "already been loaded" in body["error"]["message"]
    status, body = post_json(port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = post_json(port, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404 and "cannot be found" in body["error"]["message"]
    status, body = post_json(port, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "lora_path"
    assert {m["id"] for m in get_json(port, "/v1/models")[1]["data"]} == {"base", "alpha"}


def _stream(client: Any, model: str, started: threading.Event, results: list[Any]) -> None:
    try:
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=LONG, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        text, reason, last = "", None, 0.0
        for chunk in stream:
            started.set()
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
            last = time.monotonic()
        results.append((model, text, reason, last))
    except Exception as exc:  # noqa: BLE001 - reported by the test
        started.set()
        results.append(exc)


def test_load_and_unload_under_load(lora_server: Server, lora_dirs: dict[str, Path], expected: Any) -> None:
    client = openai_client(lora_server.base_url)
    port = lora_server.port
    status, _ = post_json(port, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(lora_dirs["beta"])})
    assert status == 200
    assert _complete(client, "beta") == expected["beta"]
    # Requests on alpha and beta stream; alpha is unloaded and beta reloaded meanwhile.
    results: list[Any] = []
    threads = []
    for model in ("alpha", "alpha", "beta", "base"):
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(client, model, started, results))
        thread.start()
        assert started.wait(120)
        threads.append((model, thread))
    status, body = post_json(port, "/v1/unload_lora_adapter", {"lora_name": "alpha"})
    assert status == 200 and "removed successfully" in body, body
    unloaded_at = time.monotonic()
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="alpha", prompt="x", max_tokens=2)
    for _, thread in threads:
        thread.join(300)
    assert all(not isinstance(r, Exception) for r in results), results
    assert any(m == "alpha" and last > unloaded_at for m, _, _, last in results), "alpha ended before its unload"
    got = sorted((m, text, reason) for m, text, reason, _ in results)
    want = sorted((m, expected[f"long-{m if m != 'base' else None}"][0], "length") for m, _ in threads)
    assert got == want
    # Loaded again under the same name: it serves, with no KV from the first load's cache reused wrongly.
    status, _ = post_json(port, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(lora_dirs["alpha"])})
    assert status == 200
    assert _complete(client, "alpha") == expected["alpha"]
    assert {m["id"] for m in get_json(port, "/v1/models")[1]["data"]} == {"base", "alpha", "beta"}


@pytest.mark.tp
def test_tp2_serves_the_same_adapters(tmp_path_factory: pytest.TempPathFactory, lora_dirs: dict[str, Path],
                                      expected: Any) -> None:  # fmt: skip
    """TP=2 over gloo: q and kv heads, gate/up split (B by rows), o/down split by input (A by
    columns, partial deltas in the all-reduce); the answers of TP=1."""
    srv = start_server(tmp_path_factory, "lora_tp2", "--model", str(lora_dirs["base"]), "--num-pages", "128",
                       "--served-model-name", "base", "--tp", "2", "--max-loras", "2", "--max-lora-rank", "8",
                       "--lora-modules", f"alpha={lora_dirs['alpha']}", f"beta={lora_dirs['beta']}")  # fmt: skip
    try:
        client = openai_client(srv.base_url)
        for name in ("alpha", "beta"):
            assert _complete(client, name) == expected[name], name
        assert _complete(client, "base") == expected[None]
    finally:
        srv.stop()
