"""Online serving benchmark against any OpenAI-compatible server (minisgl, llama.cpp's
llama-server, ...): streaming /v1/completions with text prompts of calibrated token length, greedy,
EOS ignored. Reports TTFT, ITL (gaps between streamed chunks), TPOT, end-to-end latency and output
throughput; with --runs K it also names the median run (by output tok/s).

    python -m minisgl.bench serve --url http://127.0.0.1:30000 --preset W2 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, NamedTuple

from minisgl.bench.serve_workload import (
    PRESETS, BenchRequest, TokenCounter, WorkloadConfig, arrival_offsets, build_workload,
)

UsageSource = Literal["usage", "chunks"]


def _http() -> ModuleType:
    """httpx, or its renamed fork httpx2 that some environments ship instead (same API)."""
    for name in ("httpx", "httpx2"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise SystemExit("the serve benchmark needs httpx: pip install httpx")


# ---------------------------------------------------------------------------------------------
# SSE parsing


class SseEvent(NamedTuple):
    text: str  # streamed text of this chunk ("" for usage-only or role chunks)
    usage: dict[str, Any] | None
    done: bool  # the `[DONE]` sentinel
    error: str | None


def parse_sse_line(line: str) -> SseEvent | None:
    """One line of an OpenAI (or llama.cpp native) event stream; None for anything that is not a
    `data:` line (comments, blank separators, `event:` lines)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return SseEvent("", None, True, None)
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        return SseEvent("", None, False, f"bad SSE payload: {payload[:200]}")
    if not isinstance(chunk, dict):
        return SseEvent("", None, False, f"bad SSE payload: {payload[:200]}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return SseEvent("", None, False, str(message))
    text = ""
    choices = chunk.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None) or ""
    elif isinstance(chunk.get("content"), str):  # llama.cpp's native /completion stream
        text = chunk["content"]
    usage = chunk.get("usage")
    return SseEvent(text, usage if isinstance(usage, dict) else None, False, None)


# ---------------------------------------------------------------------------------------------
# Per-request measurement


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    ok: bool = False
    ttft: float | None = None  # seconds from send to the first chunk with text
    e2e: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)  # gaps between text chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage, when given
    usage_source: UsageSource = "chunks"
    error: str | None = None


def completion_body(request: BenchRequest, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model, "prompt": request.prompt, "max_tokens": request.output_len,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, **extra,
    }


async def send_request(client: Any, url: str, body: dict[str, Any], prompt_len: int, timeout: float) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, url, body, result, start), timeout)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout:.0f}s"
    except Exception as exc:  # a benchmark reports transport failures instead of dying on them
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    result.ok = result.error is None and result.output_tokens > 0
    if result.error is None and not result.ok:
        result.error = "no tokens streamed"
    return result


async def _stream(client: Any, url: str, body: dict[str, Any], result: RequestResult, start: float) -> None:
    chunks = 0
    last = start
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {text[:300]}"
            return
        async for line in response.aiter_lines():
            event = parse_sse_line(line)
            if event is None:
                continue
            if event.done:
                break
            if event.error is not None:
                result.error = event.error
                return
            now = time.perf_counter()
            if event.text:
                chunks += 1
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
            if event.usage is not None and "completion_tokens" in event.usage:
                result.output_tokens = int(event.usage["completion_tokens"])
                result.prompt_tokens = event.usage.get("prompt_tokens")
                result.usage_source = "usage"
    if result.usage_source == "chunks":
        result.output_tokens = chunks


# ---------------------------------------------------------------------------------------------
# Statistics


class Stats(NamedTuple):
    mean: float
    p50: float
    p90: float
    p99: float


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(values: list[float]) -> Stats | None:
    if not values:
        return None
    ms = [v * 1000 for v in values]
    return Stats(sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class RunSummary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int  # from usage where given, else the calibrated lengths
    output_tokens: int
    output_tok_s: float
    request_s: float
    ttft_ms: Stats | None
    itl_ms: Stats | None
    tpot_ms: Stats | None  # (e2e - ttft) / (output tokens - 1), per request
    e2e_ms: Stats | None
    usage_source: Literal["usage", "chunks", "mixed", "none"]
    short_outputs: int  # completed with fewer tokens than requested (EOS not ignored?)
    errors: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, key)
            out[key] = None if value is None else {k: round(v, 2) for k, v in value._asdict().items()}
        out["errors"] = list(self.errors)
        return out


def summarize(results: list[RequestResult], duration: float, output_len: list[int]) -> RunSummary:
    done = [r for r in results if r.ok]
    sources = {r.usage_source for r in done}
    source: Literal["usage", "chunks", "mixed", "none"] = (
        "none" if not sources else "mixed" if len(sources) > 1 else next(iter(sources))
    )
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft is not None and r.output_tokens > 1]
    errors = tuple(dict.fromkeys(r.error for r in results if r.error is not None))[:5]
    return RunSummary(
        completed=len(done), failed=len(results) - len(done), duration_s=duration,
        input_tokens=sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done),
        output_tokens=output_tokens,
        output_tok_s=output_tokens / duration if duration > 0 else 0.0,
        request_s=len(done) / duration if duration > 0 else 0.0,
        ttft_ms=stats_ms([r.ttft for r in done if r.ttft is not None]),
        itl_ms=stats_ms([gap for r in done for gap in r.itls]),
        tpot_ms=stats_ms(tpots), e2e_ms=stats_ms([r.e2e for r in done]),
        usage_source=source,
        short_outputs=sum(1 for r, n in zip(results, output_len) if r.ok and r.output_tokens < n),
        errors=errors,
    )


def median_run(runs: list[RunSummary]) -> RunSummary:
    """The run with the median output throughput (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda run: run.output_tok_s)
    return ordered[(len(ordered) - 1) // 2]


# ---------------------------------------------------------------------------------------------
# Driving a server


@dataclass(frozen=True)
class ClientConfig:
    url: str  # base URL, no trailing slash
    model: str
    concurrency: int
    request_rate: float | None
    timeout: float  # per request, seconds
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)


async def run_once(config: ClientConfig, requests: list[BenchRequest], seed: int) -> RunSummary:
    http = _http()
    slots = config.concurrency + 2
    limits = http.Limits(max_connections=slots, max_keepalive_connections=slots)
    offsets = arrival_offsets(len(requests), config.request_rate, seed)
    semaphore = asyncio.Semaphore(config.concurrency)
    endpoint = f"{config.url}/v1/completions"
    async with http.AsyncClient(timeout=http.Timeout(config.timeout), limits=limits, trust_env=False) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:
                body = completion_body(request, config.model, config.extra_body)
                return await send_request(client, endpoint, body, request.prompt_len, config.timeout)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    return summarize(list(results), duration, [r.output_len for r in requests])


def server_token_counter(url: str, timeout: float = 30.0) -> TokenCounter | None:
    """llama.cpp-style `POST /tokenize {"content": ...}`, if the server has it."""
    client = _http().Client(timeout=timeout, trust_env=False)

    def count(text: str) -> int:
        response = client.post(f"{url}/tokenize", json={"content": text})
        response.raise_for_status()
        return len(response.json()["tokens"])

    try:
        count("hello world")
    except Exception:  # any failure just means "no usable /tokenize"
        client.close()
        return None
    return count


def local_token_counter(model: str | None) -> TokenCounter:
    """The Hugging Face tokenizer of `model` (default: the embedded SmolLM2, as served)."""
    from transformers import AutoTokenizer

    from minisgl.models.source import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(model)))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def served_model_name(url: str) -> str:
    try:
        response = _http().get(f"{url}/v1/models", timeout=10.0, trust_env=False)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except Exception:  # the model field is informational for single-model servers
        return "default"


def _warm_up(config: ClientConfig, count: int) -> None:
    warm = [BenchRequest(f"Warm-up request {i}: say something about the weather", 0, 8) for i in range(count)]
    if warm:
        summary = asyncio.run(run_once(dataclasses.replace(config, concurrency=1, request_rate=None), warm, 0))
        if summary.failed:
            print(f"[bench] warm-up failed: {'; '.join(summary.errors)}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000", help="base URL of the server")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()))
    p.add_argument("--num-requests", type=int, default=None, help="(default: preset, else 32)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: preset, else 32)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--min-input", type=int, default=None, help="prompt tokens, or question tokens with a shared prefix")
    p.add_argument("--max-input", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--shared-prefix", type=int, default=None, help="tokens of system text shared by every prompt")
    p.add_argument("--seed", type=int, default=0, help="run k uses seed+k, so runs do not hit each other's cache")
    p.add_argument("--model", default=None, help="model field of requests (default: first of /v1/models)")
    p.add_argument("--tokenizer", choices=["auto", "server", "local"], default="auto",
                   help="length calibration: the server's /tokenize, a local HF tokenizer, or server if it has one")
    p.add_argument("--tokenizer-model", default=None, help="model for the local tokenizer (default: embedded SmolLM2)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured short requests first")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--label", default=None, help="name of the server in the output")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    return p


def _resolve(args: argparse.Namespace) -> tuple[WorkloadConfig, int]:
    preset = PRESETS[args.preset] if args.preset else PRESETS["W2"]

    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    workload = WorkloadConfig(
        num_requests=pick(args.num_requests, preset.num_requests),
        min_input=pick(args.min_input, preset.min_input), max_input=pick(args.max_input, preset.max_input),
        output_len=pick(args.output_len, preset.output_len),
        shared_prefix=pick(args.shared_prefix, preset.shared_prefix), seed=args.seed,
    )
    concurrency = pick(args.concurrency, preset.concurrency)
    if concurrency < 1 or args.runs < 1 or args.timeout <= 0:
        raise ValueError("--concurrency and --runs must be >= 1, --timeout > 0")
    return workload, concurrency


def _fmt(stats: Stats | None) -> str:
    return "     n/a" if stats is None else "".join(f"{v:9.1f}" for v in stats)


def report(result: dict[str, Any], runs: list[RunSummary], median: RunSummary) -> str:
    work = result["workload"]
    prefix = f"{work['shared_prefix']}-token shared prefix + " if work["shared_prefix"] else ""
    lines = [f"{result['label']} {result['preset'] or 'custom'} @ {result['url']}  model={result['model']}  "
             f"tokenizer={result['tokenizer']}",
             f"{work['num_requests']} requests, concurrency {result['concurrency']}, {prefix}"
             f"{work['min_input']}-{work['max_input']} input tokens, {work['output_len']} output tokens"]
    for i, run in enumerate(runs):
        lines.append(f"run {i + 1}/{len(runs)}: {run.completed} ok, {run.failed} failed, {run.duration_s:.1f} s, "
                     f"{run.output_tok_s:.1f} output tok/s")
    lines.append(f"median run: {median.output_tok_s:.1f} output tok/s, {median.request_s:.2f} req/s, "
                 f"{median.input_tokens} input / {median.output_tokens} output tokens (counted from {median.usage_source})")
    lines.append(f"{'(ms)':6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}")
    for name, stats in (("TTFT", median.ttft_ms), ("ITL", median.itl_ms), ("TPOT", median.tpot_ms), ("E2E", median.e2e_ms)):
        lines.append(f"{name:6}{_fmt(stats)}")
    if median.short_outputs:
        lines.append(f"warning: {median.short_outputs} requests stopped before their output length (EOS not ignored?)")
    for error in median.errors:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        workload, concurrency = _resolve(args)
        extra_body = json.loads(args.extra_body)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    counter = None if args.tokenizer == "local" else server_token_counter(url)
    if counter is None and args.tokenizer == "server":
        print(f"error: {url}/tokenize is not available", file=sys.stderr)
        return 2
    tokenizer = "server" if counter is not None else "local"
    if counter is None:
        counter = local_token_counter(args.tokenizer_model)
    workloads = [build_workload(dataclasses.replace(workload, seed=args.seed + k), counter) for k in range(args.runs)]
    config = ClientConfig(url, args.model or served_model_name(url), concurrency, args.request_rate, args.timeout, extra_body)
    _warm_up(config, args.warmup)
    runs = []
    for k, requests in enumerate(workloads):
        runs.append(asyncio.run(run_once(config, requests, args.seed + k)))
        print(f"[bench] run {k + 1}/{args.runs}: {runs[-1].output_tok_s:.1f} output tok/s, "
              f"{runs[-1].failed} failed", file=sys.stderr)
    median = median_run(runs)
    result: dict[str, Any] = {
        "label": args.label or url, "url": url, "model": config.model, "preset": args.preset,
        "workload": dataclasses.asdict(workload), "concurrency": concurrency, "request_rate": args.request_rate,
        "tokenizer": tokenizer, "runs": [run.to_dict() for run in runs],
        "median_run": runs.index(median), "median": median.to_dict(),
    }
    print(json.dumps(result) if args.json else report(result, runs, median), flush=True)
    return 1 if any(run.failed for run in runs) else 0
