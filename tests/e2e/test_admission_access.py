"""Admission control behind the API key, against the real server on CPU: one server with a key and
room for a single request in flight (1 running + 0 queued).

- while that request holds the slot, a request without a valid key gets 401 (not 503), and one
  with the key gets 503 with Retry-After;
- /metrics shows the 503s as `minisgl_rejected_requests_total` (the 401s are not counted);
- while draining (SIGTERM) the same holds, and /health still answers 503 "draining" without a key;
- every route but /health needs the key: the generation routes, /tokenize, /detokenize, /v1/models,
  /metrics, /v1/internal/stats, /openapi.json, /docs (and its assets), unknown routes.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.service import Server, start_server
from tests.e2e.test_api_endpoints import call, value

KEY = "sk-admission-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
SHORT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LONG = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
        "max_tokens": 4000, "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory, "keyed-bounded", "--api-key", KEY, "--num-pages", "512",
                       "--max-running-requests", "1", "--max-queued-requests", "0",
                       "--shutdown-timeout", "60")  # fmt: skip
    yield srv
    srv.stop()


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics (behind the key), parsed as test_api_endpoints.scrape does."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, text = call(port, "GET", "/metrics", AUTH)
    assert status == 200 and headers.get("content-type", "").startswith("text/plain"), (status, text)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


# (method, path, body, status with the key): cheap requests; bad bodies prove the key was accepted.
ROUTES = [
    ("GET", "/v1/models", None, 200), ("GET", "/v1/models/nope", None, 404), ("GET", "/metrics", None, 200),
    ("GET", "/v1/internal/stats", None, 200), ("GET", "/openapi.json", None, 200), ("GET", "/docs", None, 200),
    ("GET", "/docs/assets/swagger-ui.css", None, 200), ("GET", "/nope", None, 404),
    ("POST", "/tokenize", {"prompt": "x"}, 200), ("POST", "/detokenize", {"tokens": [1]}, 200),
    ("POST", "/generate", {"sampling_params": {}}, 400), ("POST", "/v1/completions", {"prompt": ""}, 400),
    ("POST", CHAT, {"messages": []}, 400), ("POST", "/v1/embeddings", {}, 400),
]  # fmt: skip


@pytest.mark.parametrize("method, path, body, with_key", ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_every_route_but_health_needs_the_key(full: Server, method: str, path: str, body: Any,
                                              with_key: int) -> None:  # fmt: skip
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, data = call(full.port, method, path, headers, body)
        assert status == 401 and data["error"]["code"] == "invalid_api_key", (headers, status, data)
    status, _, data = call(full.port, method, path, AUTH, body)
    assert status == with_key, (status, data)
    status, _, data = call(full.port, "GET", "/health", {})
    assert status == 200 and data["status"] == "ok"


def hold_the_slot(port: int) -> http.client.HTTPConnection:
    """An authenticated stream that runs far longer than the test: the one slot is taken once its
    headers are back. Closing the connection aborts it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", CHAT, body=json.dumps(LONG).encode(), headers={"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline().startswith(b"data: ")  # streaming: the request runs
    return conn


def wait_in_flight(port: int, want: int, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    metrics = scrape(port)
    while value(metrics, "minisgl_num_requests_in_flight") != want and time.monotonic() < deadline:
        time.sleep(0.1)
        metrics = scrape(port)
    assert value(metrics, "minisgl_num_requests_in_flight") == want
    return metrics


def assert_unauthorized(port: int) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, data = call(port, "POST", CHAT, headers, SHORT)
        assert status == 401, (status, data)
        assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["code"] == "invalid_api_key"


def test_overload_answers_401_before_503_and_counts_the_503(full: Server) -> None:
    openai = pytest.importorskip("openai")
    before = wait_in_flight(full.port, 0)
    conn = hold_the_slot(full.port)
    try:
        held = wait_in_flight(full.port, 1)
        assert value(held, "minisgl_admitted_requests_total") - value(before, "minisgl_admitted_requests_total") == 1
        assert_unauthorized(full.port)  # full, but no valid key: 401, whatever the load
        status, headers, data = call(full.port, "POST", CHAT, AUTH, SHORT)
        assert status == 503 and headers["retry-after"] == "1", (status, data)
        assert "overloaded" in data["error"]["message"] and data["error"]["code"] == "service_unavailable"
        client = openai.OpenAI(base_url=f"{full.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(**SHORT)
        assert refused.value.status_code == 503
        bad = openai.OpenAI(base_url=f"{full.base_url}/v1", api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(**SHORT)
        after = scrape(full.port)
        # Two 503s, exactly; the four 401s are neither rejected nor admitted.
        assert value(after, "minisgl_rejected_requests_total") - value(before, "minisgl_rejected_requests_total") == 2
        assert value(after, "minisgl_admitted_requests_total") == value(held, "minisgl_admitted_requests_total")
        assert value(after, "minisgl_num_requests_in_flight") == 1
        for name in ("minisgl_timed_out_requests_total", "minisgl_drain_aborted_requests_total"):
            assert value(after, name) == 0, name
    finally:
        conn.close()
    wait_in_flight(full.port, 0)  # the slot is free again: the key still works
    client = openai.OpenAI(base_url=f"{full.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert client.chat.completions.create(**SHORT).choices[0].message.content is not None


def test_draining_answers_401_before_503(full: Server) -> None:
    """Last in this module: it stops the server."""
    conn = hold_the_slot(full.port)  # keeps the drain going until it is closed
    try:
        wait_in_flight(full.port, 1)
        os.kill(full.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while call(full.port, "GET", "/health", {})[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, _, data = call(full.port, "GET", "/health", {})  # no key needed, as before
        assert status == 503 and data["status"] == "draining"
        assert_unauthorized(full.port)
        status, headers, data = call(full.port, "POST", CHAT, AUTH, SHORT)
        assert status == 503 and headers["retry-after"] == "1" and "shutting down" in data["error"]["message"]
    finally:
        conn.close()
    assert full.proc.wait(60) == 0
