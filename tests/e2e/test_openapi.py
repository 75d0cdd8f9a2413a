"""GET /openapi.json and GET /docs against the real server on CPU, and a bounded schemathesis run
against the server's own schema with 0 server errors.

The server runs with a 64-token context (the small-context server shared with test_fuzz.py), so a generated body that is valid
costs at most a few dozen tokens.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.e2e.service import Server, get_json, request, wait_idle

FUZZ_SECONDS = 75
BODY_ROUTES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
               "/generate": "GenerateRequest", "/tokenize": "TokenizeRequest",
               "/detokenize": "DetokenizeRequest", "/v1/embeddings": "EmbeddingRequest"}  # fmt: skip


@pytest.fixture(scope="module")
def docs_server(small_context_server: Server) -> Server:
    return small_context_server


def test_openapi_is_valid_and_documents_the_bodies(docs_server: Server) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    status, spec = get_json(docs_server.port, "/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    validator.validate(spec)
    schemas = spec["components"]["schemas"]
    for path, model in BODY_ROUTES.items():
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        props = schemas[model]["properties"]
        undocumented = [name for name, prop in props.items() if not prop.get("description")]
        assert not undocumented, (model, undocumented)
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"] and {"tools", "response_format", "logprobs"} <= set(chat["properties"])
    assert {"/v1/models", "/health", "/metrics", "/v1/internal/stats"} <= set(spec["paths"])


def test_docs_page_works_offline(docs_server: Server) -> None:
    status, page = request(docs_server.port, "GET", "/docs")
    html = page.decode()
    assert status == 200 and "SwaggerUIBundle" in html and "/openapi.json" in html
    urls = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert urls and all(url.startswith("/docs/assets/") for url in urls), urls  # nothing from elsewhere
    for url in urls:
        status, data = request(docs_server.port, "GET", url)
        assert status == 200 and len(data) > 100, url
    status, js = request(docs_server.port, "GET", "/docs/assets/swagger-ui-bundle.js")
    assert b"SwaggerUIBundle" in js
    assert request(docs_server.port, "GET", "/docs/assets/..%2fopenapi.py")[0] == 404
    assert request(docs_server.port, "GET", "/docs/assets/index.html")[0] == 404


def test_schemathesis_finds_no_server_error(docs_server: Server, tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("schemathesis")
    exe = shutil.which("schemathesis") or shutil.which("st")
    cmd = [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]
    report = tmp_path_factory.mktemp("schemathesis")
    cmd += ["run", f"{docs_server.base_url}/openapi.json", "--checks", "not_a_server_error",
            "--max-examples", "30", "--max-time", str(FUZZ_SECONDS), "--workers", "1", "--seed", "1",
            "--request-timeout", "60", "--report", "junit", "--report-dir", str(report)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=FUZZ_SECONDS + 120, cwd=report)  # its cache too
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]  # exit 1 on any failed check (a 5xx)
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert counts and int(counts.group(1)) >= 100 and counts.group(1) == counts.group(2), out[-3000:]
    status, health = get_json(docs_server.port, "/health")
    assert status == 200 and health["status"] == "ok"
    wait_idle(docs_server.port, timeout=60)
    log = docs_server.log()
    assert "Traceback" not in log, log[-4000:]
    assert "internal error" not in log, log[-4000:]
