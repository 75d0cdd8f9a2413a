"""Bounds on hostile input, without a server: the grammar compile limits and deadline
(engine/grammar.py), the body limit and API key (server/access.py), the OpenAPI document and
offline /docs (server/openapi.py), on the real app with no workers behind it."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from minisgl.engine import grammar
from minisgl.engine.grammar import GrammarBackend, check_grammar

fastapi_testclient = pytest.importorskip("fastapi.testclient")


def wide(optional: int, required: int = 0) -> str:
    props = {f"p{i}": {"type": "string"} for i in range(optional + required)}
    return json.dumps({"type": "object", "properties": props, "required": [f"p{i}" for i in range(required)]})


@pytest.mark.parametrize(
    "kind, text, needle",
    [("regex", "[a-z]{1,10001}", "repeats 10001"), ("regex", "a{20000}", "repeats 20000"),
     ("regex", "x" * 16_385, "too long"), ("regex", "(" * 65 + ")" * 65, "nests 65"),
     ("json_schema", json.dumps({"type": "string", "pattern": "b{0,50000}"}), "repeats 50000"),
     ("json_schema", " " * 65_537, "too long"), ("json_schema", wide(201), "201 optional"),
     ("json_schema", wide(0, 1001), "1001 properties"),
     ("json_schema", "[" * 70 + "]" * 70, "nests 70 levels")],
    ids=["range", "exact", "long-regex", "deep-regex", "pattern", "long-schema", "optional", "properties", "deep"],
)  # fmt: skip
def test_grammars_beyond_the_limits_are_refused(kind: str, text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check_grammar(kind, text)


@pytest.mark.parametrize(
    "kind, text",
    [("regex", "(a+)+$"), ("regex", "[a-z]{1,10000}"), ("regex", r"\((\(\(x\)\))\)" * 40),
     ("json_schema", wide(200)), ("json_schema", wide(50, 950)),
     ("json_schema", json.dumps({"type": "string", "pattern": "[{]{1,3}"})),
     ("json_schema", json.dumps({"type": "string", "description": "{" * 500}))],
    ids=["nested-plus", "range", "escaped-groups", "optional", "required", "pattern", "braces-in-strings"],
)  # fmt: skip
def test_grammars_within_the_limits_pass(kind: str, text: str) -> None:
    check_grammar(kind, text)


class _SlowCompiler:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0

    def compile_regex(self, text: str) -> str:
        self.calls += 1
        time.sleep(self.seconds)
        return f"compiled {text}"


def _backend(seconds: float, timeout: float) -> GrammarBackend:
    backend = GrammarBackend.__new__(GrammarBackend)  # no tokenizer: a stand-in compiler
    backend.compiler = _SlowCompiler(seconds)
    backend._compiled = {}
    backend.timeout = timeout
    backend._overdue = None
    return backend


def test_compile_past_the_deadline_is_refused_then_cached() -> None:
    backend = _backend(seconds=0.6, timeout=0.1)
    start = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within 0.1 s"):
        backend.compile(("regex", "a"))
    assert time.monotonic() - start < 0.5
    with pytest.raises(ValueError, match="still compiling an earlier grammar"):
        backend.compile(("regex", "b"))  # refused, not piled up behind the overdue one
    assert backend.compiler.calls == 1
    assert backend._overdue is not None
    backend._overdue.join(5)
    assert backend.compile(("regex", "a")) == "compiled a"  # finished in the background: cached
    assert backend.compiler.calls == 1
    backend.timeout = 5.0
    assert backend.compile(("regex", "b")) == "compiled b"
    assert not any(t.name == "grammar-compile" for t in threading.enumerate())


def test_default_deadline_is_set() -> None:
    assert 0 < grammar.COMPILE_TIMEOUT_S <= 30


# ------------------------------------------------------------------------------------ the app


def _client(api_key: str | None = None, max_body: int | None = None) -> Any:
    from minisgl.server.api_server import AppState, create_app
    from minisgl.server.frontend import FrontendAddrs

    state = AppState(FrontendAddrs("ipc:///nonexistent/a", "ipc:///nonexistent/b", "ipc:///nonexistent/c"),
                     "m", 64, lambda: (True, {}), api_key=api_key)  # fmt: skip
    if max_body is not None:
        state.max_body_bytes = max_body
    return fastapi_testclient.TestClient(create_app(state))  # no lifespan: nothing is sent anywhere


def test_body_over_the_limit_is_413() -> None:
    client = _client(max_body=1000)
    resp = client.post("/v1/completions", content=b"x" * 1001, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    chunks = (b"y" * 300 for _ in range(10))  # chunked: no Content-Length, counted as it arrives
    resp = client.post("/tokenize", content=chunks, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    resp = client.post("/tokenize", content=b"[1]", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400  # under the limit: read and refused for what it is


def test_every_route_but_health_needs_the_key() -> None:
    client = _client(api_key="k")
    for method, path in [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/assets/swagger-ui.css"),
                         ("GET", "/metrics"), ("GET", "/v1/internal/stats"), ("GET", "/v1/models"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/generate"),
                         ("GET", "/nope")]:  # fmt: skip
        resp = client.request(method, path)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", path
    assert client.get("/openapi.json", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_openapi_documents_every_body_and_docs_are_local() -> None:
    from openapi_spec_validator import validate

    client = _client()
    spec = client.get("/openapi.json").json()
    validate(spec)
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/detokenize"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        model = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert all(p.get("description") for p in model["properties"].values()), path
    page = client.get("/docs").text
    assert "https://" not in page and "http://" not in page and "/docs/assets/swagger-ui-bundle.js" in page
    assert client.get("/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert client.get("/docs/assets/oauth2-redirect.html").status_code == 404
