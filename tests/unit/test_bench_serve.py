"""The online benchmark client: workload builders, statistics, SSE parsing, and a full run against
a tiny in-process fake OpenAI streaming server on a loopback port."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from minisgl.bench import serve
from minisgl.bench.serve import (
    ClientConfig, RequestResult, RunSummary, median_run, parse_sse_line, percentile, run_once,
    server_token_counter, stats_ms, summarize,
)
from minisgl.bench.serve_workload import (
    PRESETS, WORDS, BenchRequest, WorkloadConfig, arrival_offsets, build_workload, make_text,
)


def word_count(text: str) -> int:
    return len(text.split())


def lumpy_count(text: str) -> int:
    """Words of 6+ letters cost two tokens, so calibration has to correct its first guess."""
    return sum(2 if len(word) >= 6 else 1 for word in text.split())


# --- workloads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("counter", [word_count, lumpy_count])
def test_prompts_have_requested_lengths(counter: Any) -> None:
    config = WorkloadConfig(num_requests=20, min_input=64, max_input=512, output_len=128, seed=3)
    requests = build_workload(config, counter)
    assert len(requests) == 20
    for request in requests:
        assert 64 <= request.prompt_len <= 512
        assert counter(request.prompt) == request.prompt_len
        assert request.output_len == 128
    assert len({r.prompt_len for r in requests}) > 5  # lengths really are spread


def test_make_text_hits_target_exactly_with_multi_token_words() -> None:
    rng = random.Random(0)
    for target in (1, 2, 7, 128, 400):
        text, count = make_text(rng, lumpy_count, target)
        assert count == lumpy_count(text)
        assert target - 1 <= count <= target  # a 2-token word can make the exact count unreachable
        assert all(word in WORDS for word in text.split())


def test_workload_is_deterministic_and_seeded() -> None:
    config = WorkloadConfig(num_requests=8, min_input=10, max_input=50, output_len=4, seed=1)
    assert build_workload(config, word_count) == build_workload(config, word_count)
    other = WorkloadConfig(num_requests=8, min_input=10, max_input=50, output_len=4, seed=2)
    assert build_workload(config, word_count) != build_workload(other, word_count)


def test_shared_prefix_workload() -> None:
    preset = PRESETS["W3"]
    config = WorkloadConfig(num_requests=preset.num_requests, min_input=preset.min_input, max_input=preset.max_input,
                            output_len=preset.output_len, shared_prefix=preset.shared_prefix)
    requests = build_workload(config, word_count)
    prefix = requests[0].prompt.split("\n\n")[0]
    assert word_count(prefix) == 400
    assert all(r.prompt.startswith(prefix + "\n\nQuestion ") for r in requests)
    assert len({r.prompt for r in requests}) == len(requests)
    questions = [r.prompt.split("\n\n", 1)[1] for r in requests]
    for request, question in zip(requests, questions):
        assert request.prompt_len == word_count(request.prompt)
        # "Question N:" is two words; the question itself is 16..32 words.
        assert 16 <= word_count(question) - 2 <= 32
        assert request.output_len == 64


def test_workload_config_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(num_requests=1, min_input=10, max_input=5, output_len=1)
    with pytest.raises(ValueError):
        WorkloadConfig(num_requests=0, min_input=1, max_input=5, output_len=1)


def test_arrival_offsets() -> None:
    assert arrival_offsets(4, None, 0) == [0.0] * 4
    offsets = arrival_offsets(2000, 10.0, 0)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets == arrival_offsets(2000, 10.0, 0)
    assert abs(offsets[-1] / 2000 - 0.1) < 0.01  # mean gap 1/rate


# --- statistics ---------------------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for size in (1, 2, 5, 101):
        values = [rng.random() for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)
    stats = stats_ms([0.001, 0.002, 0.003])
    assert stats is not None and stats.mean == pytest.approx(2.0) and stats.p50 == pytest.approx(2.0)
    assert stats_ms([]) is None


def _result(ttft: float, e2e: float, tokens: int, source: str = "usage", error: str | None = None) -> RequestResult:
    return RequestResult(prompt_len=10, ok=error is None, ttft=ttft, e2e=e2e, itls=[0.01] * max(tokens - 1, 0),
                         output_tokens=tokens, prompt_tokens=12 if source == "usage" else None,
                         usage_source=source, error=error)  # type: ignore[arg-type]


def test_summarize() -> None:
    results = [_result(0.1, 1.1, 101), _result(0.2, 2.2, 101, source="chunks"), _result(0.3, 0.3, 0, error="HTTP 500: x"),
               _result(0.1, 0.5, 50)]
    summary = summarize(results, duration=2.0, output_len=[101, 101, 101, 101])
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.output_tokens == 252 and summary.output_tok_s == pytest.approx(126.0)
    assert summary.input_tokens == 12 + 10 + 12
    assert summary.usage_source == "mixed" and summary.short_outputs == 1
    assert summary.errors == ("HTTP 500: x",)
    assert summary.tpot_ms is not None and summary.tpot_ms.p50 == pytest.approx(10.0)  # (1.1-0.1)/100 s
    assert summary.e2e_ms is not None and summary.e2e_ms.mean == pytest.approx(1266.67, abs=0.01)
    assert summary.itl_ms is not None and summary.itl_ms.p99 == pytest.approx(10.0)
    assert json.loads(json.dumps(summary.to_dict()))["ttft_ms"]["p50"] == 100.0


def test_median_run() -> None:
    def run(tok_s: float) -> RunSummary:
        return RunSummary(1, 0, 1.0, 1, 1, tok_s, 1.0, None, None, None, None, "usage", 0, ())

    assert median_run([run(3.0), run(1.0), run(2.0)]).output_tok_s == 2.0
    assert median_run([run(4.0), run(1.0), run(2.0), run(3.0)]).output_tok_s == 2.0
    assert median_run([run(5.0)]).output_tok_s == 5.0


# --- SSE parsing --------------------------------------------------------------------------------


def test_parse_sse_lines() -> None:
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None and parse_sse_line("event: x") is None
    assert parse_sse_line("data: [DONE]") == ("", None, True, None)
    event = parse_sse_line('data: {"choices": [{"index": 0, "text": " hi", "finish_reason": null}]}')
    assert event is not None and event.text == " hi" and event.usage is None and not event.done
    chat = parse_sse_line('data:{"choices": [{"delta": {"content": "yo"}}]}')
    assert chat is not None and chat.text == "yo"
    role = parse_sse_line('data: {"choices": [{"delta": {"role": "assistant"}}]}')
    assert role is not None and role.text == ""
    usage = parse_sse_line('data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}')
    assert usage is not None and usage.text == "" and usage.usage == {"prompt_tokens": 3, "completion_tokens": 7}
    native = parse_sse_line('data: {"content": "x", "stop": false}')
    assert native is not None and native.text == "x"
    error = parse_sse_line('data: {"error": {"message": "boom", "code": 500}}')
    assert error is not None and error.error == "boom"
    bad = parse_sse_line("data: {not json")
    assert bad is not None and bad.error is not None and bad.error.startswith("bad SSE payload")


# --- against a fake streaming server ------------------------------------------------------------


def _handler(with_usage: bool) -> type[BaseHTTPRequestHandler]:
    class FakeOpenAI(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self._json(200, {"tokens": list(range(word_count(body["content"])))})
                return
            assert self.path == "/v1/completions"
            if "FAIL" in body["prompt"]:
                self._json(400, {"error": {"message": "bad prompt", "type": "invalid_request_error"}})
                return
            assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(body["max_tokens"]):
                self._event({"object": "text_completion", "choices": [{"index": 0, "text": " w", "finish_reason": None}]})
                time.sleep(0.001)
            if with_usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": word_count(body["prompt"]), "completion_tokens": body["max_tokens"]}
                self._event({"object": "text_completion", "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, chunk: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

    return FakeOpenAI


@pytest.fixture(params=[True, False], ids=["usage", "no-usage"])
def fake_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(with_usage=request.param))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", request.param
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_run_against_fake_server(fake_server: tuple[str, bool]) -> None:
    url, with_usage = fake_server
    requests = build_workload(WorkloadConfig(num_requests=6, min_input=5, max_input=20, output_len=9), word_count)
    requests.append(BenchRequest("please FAIL", 2, 9))
    config = ClientConfig(url=url, model="fake-model", concurrency=3, request_rate=None, timeout=20.0)
    summary = asyncio.run(run_once(config, requests, seed=0))
    assert (summary.completed, summary.failed) == (6, 1)
    assert summary.output_tokens == 6 * 9 and summary.short_outputs == 0
    assert summary.usage_source == ("usage" if with_usage else "chunks")
    assert summary.input_tokens == sum(r.prompt_len for r in requests[:6])
    assert summary.errors and summary.errors[0].startswith("HTTP 400")
    assert summary.ttft_ms is not None and summary.itl_ms is not None and summary.itl_ms.p50 >= 0.5
    assert serve.served_model_name(url) == "fake-model"


def test_cli_json_against_fake_server(fake_server: tuple[str, bool], capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = fake_server
    counter = server_token_counter(url)
    assert counter is not None and counter("a b c") == 3
    code = serve.main(["--url", url, "--num-requests", "4", "--concurrency", "2", "--min-input", "8",
                       "--max-input", "16", "--output-len", "5", "--runs", "3", "--tokenizer", "server", "--json",
                       "--label", "fake"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["label"] == "fake" and result["tokenizer"] == "server" and result["model"] == "fake-model"
    assert len(result["runs"]) == 3 and result["median"] == result["runs"][result["median_run"]]
    assert result["median"]["completed"] == 4 and result["median"]["output_tokens"] == 20


def test_unreachable_server_fails_requests_not_the_client() -> None:
    config = ClientConfig(url="http://127.0.0.1:9", model="x", concurrency=1, request_rate=None, timeout=5.0)
    summary = asyncio.run(run_once(config, [BenchRequest("hi", 1, 2)], seed=0))
    assert summary.completed == 0 and summary.failed == 1 and summary.errors
