"""The LoRA routes' refusals that need no engine: OpenAI's error shape, vLLM's statuses."""

from __future__ import annotations

from typing import Any

from fastapi import testclient

from minisgl.server.lora_registry import LoraRegistry


def _client(lora: LoraRegistry) -> Any:
    from minisgl.server.api_server import AppState, create_app
    from minisgl.server.frontend import FrontendAddrs

    state = AppState(FrontendAddrs("ipc:///nonexistent/a", "ipc:///nonexistent/b", "ipc:///nonexistent/c"),
                     "base", 64, lambda: (True, {}), lora=lora)  # fmt: skip
    return testclient.TestClient(create_app(state))  # no lifespan: nothing is sent anywhere


def test_without_lora_the_routes_refuse_and_any_model_name_runs() -> None:
    client = _client(LoraRegistry())
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert resp.status_code == 400 and "not enabled" in resp.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 400
    assert LoraRegistry().adapter_for("anything", "base") is None  # as before adapters existed


def test_with_lora_unknown_names_are_404() -> None:
    client = _client(LoraRegistry(True, {"alpha": "/adapters/alpha"}))
    resp = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    body = resp.json()["error"]
    assert resp.status_code == 404 and body["type"] == "not_found_error" and body["param"] == "model"
    resp = client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 404
    resp = client.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert resp.status_code == 404 and "cannot be found" in resp.json()["error"]["message"]
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "/x"})
    assert resp.status_code == 400 and "already been loaded" in resp.json()["error"]["message"]
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "/x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_name"
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["base", "alpha"] and cards[1]["parent"] == "base"
    assert cards[1]["root"] == "/adapters/alpha"
    assert client.get("/v1/models/alpha").json()["parent"] == "base"
    assert client.get("/v1/models/beta").status_code == 404
    registry = LoraRegistry(True, {"alpha": "/a"})
    assert registry.adapter_for("alpha", "base") == "alpha" and registry.adapter_for("base", "base") is None
    assert registry.adapter_for(None, "base") is None
