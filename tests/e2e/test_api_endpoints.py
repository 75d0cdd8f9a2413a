"""POST /tokenize, POST /detokenize and GET /metrics (parsed with prometheus_client's parser);
an API key and CORS origins on a server of their own."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from tests.e2e.service import API_KEY, CORS_ORIGIN, Server, post_json

MSGS = [{"role": "user", "content": "Count to three."}]


def test_tokenize_prompt_and_messages(server, client):
    status, body = post_json(server.port, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=1, temperature=0)
    status, chat = post_json(server.port, "/tokenize", {"model": "m", "messages": MSGS})
    assert status == 200 and chat["count"] == r.usage.prompt_tokens
    status, bare = post_json(server.port, "/tokenize", {"messages": MSGS, "add_generation_prompt": False})
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]
    status, back = post_json(server.port, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "Hello world"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
    ("/tokenize", {"messages": [{"role": 7, "content": "x"}]}, "messages"),  # custom string roles are allowed
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": [1, 10_000_000]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])  # fmt: skip
def test_tokenize_errors(server, path, body, param):
    status, data = post_json(server.port, path, body)
    assert status == 400 and data["error"]["param"] == param, data


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/plain")
    text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def value(metrics: dict[str, Any], name: str, **labels: str) -> float:
    return metrics.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def test_metrics_parse_and_move(server, client):
    before = scrape(server.port)
    for name in ("minisgl_num_requests_running", "minisgl_num_requests_waiting", "minisgl_kv_cache_usage_ratio",
                 "minisgl_prefix_cache_hit_ratio"):  # fmt: skip
        assert name in before, sorted(before)
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})  # same prompt: a prefix-cache hit
    after = scrape(server.port)
    assert value(after, "minisgl_requests_total", finish_reason="length") - value(
        before, "minisgl_requests_total", finish_reason="length") == 2
    assert value(after, "minisgl_generation_tokens_total") - value(before, "minisgl_generation_tokens_total") == 8
    assert value(after, "minisgl_prompt_tokens_total") - value(before, "minisgl_prompt_tokens_total") == \
        2 * r.usage.prompt_tokens  # fmt: skip
    for hist in ("minisgl_time_to_first_token_seconds", "minisgl_e2e_request_latency_seconds"):
        assert value(after, hist + "_count") - value(before, hist + "_count") == 2
        assert value(after, hist + "_bucket", le="+Inf") == value(after, hist + "_count")
    assert value(after, "minisgl_inter_token_latency_seconds_count") - value(
        before, "minisgl_inter_token_latency_seconds_count") == 6  # 3 gaps per request
    assert 0 <= value(after, "minisgl_kv_cache_usage_ratio") <= 1
    assert 0 < value(after, "minisgl_prefix_cache_hit_ratio") <= 1
    # Rejected requests count as errors.
    post_json(server.port, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 10**6})
    assert value(scrape(server.port), "minisgl_requests_total", finish_reason="error") >= 1


# ---------------------------------------------------------------- access

KEY = API_KEY  # the shared keyed server (tests/e2e/conftest.py)
ORIGIN = CORS_ORIGIN


@pytest.fixture(scope="module")
def keyed(keyed_server: Server) -> Server:
    return keyed_server


def call(port: int, method: str, path: str, headers: dict[str, str], body: Any = None) -> tuple[int, Any, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        raw = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, resp.headers, json.loads(data) if data.startswith(b"{") else data
    finally:
        conn.close()


def test_api_key_required(keyed):
    openai = pytest.importorskip("openai")
    body = {"model": "m", "messages": MSGS, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, data = call(keyed.port, "POST", "/v1/chat/completions", headers, body)
        assert status == 401 and set(data["error"]) == {"message", "type", "param", "code"}, data
        assert data["error"]["code"] == "invalid_api_key"
    assert call(keyed.port, "GET", "/v1/models", {})[0] == 401
    assert call(keyed.port, "POST", "/tokenize", {}, {"prompt": "x"})[0] == 401
    assert call(keyed.port, "GET", "/health", {})[0] == 200
    assert call(keyed.port, "GET", "/metrics", {})[0] == 401  # every route but /health needs the key
    assert call(keyed.port, "GET", "/metrics", {"Authorization": f"Bearer {KEY}"})[0] == 200
    good = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert good.chat.completions.create(model="m", messages=MSGS, max_tokens=2).choices[0].message.content is not None
    bad = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="nope", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_cors(keyed):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    status, headers, _ = call(keyed.port, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = call(keyed.port, "GET", "/v1/models", {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = call(keyed.port, "GET", "/v1/models", {"Origin": ORIGIN})  # 401s carry CORS headers too
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = call(keyed.port, "GET", "/v1/models", {"Origin": "http://evil.test",
                                                                 "Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert "access-control-allow-origin" not in headers
    status, _, _ = call(keyed.port, "OPTIONS", "/v1/models", {**preflight, "Origin": "http://evil.test"})
    assert status == 400
