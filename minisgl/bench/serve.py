"""Online serving benchmark against any OpenAI-compatible server (minisgl, llama.cpp's
llama-server, ...): streaming /v1/completions with text prompts of calibrated token length, greedy,
EOS ignored. Reports TTFT, ITL (gaps between streamed chunks), TPOT, end-to-end latency and output
throughput; with --runs K it also names the median run (by output tok/s).

    python -m minisgl.bench serve --url http://127.0.0.1:30000 --preset W2 --runs 3

A comma list sweeps one setting (`--concurrency 1,4,16` or `--request-rate 0.5,1,2`): each value
is a full benchmark of its own (with `--json`, one JSON line each). `--plot out.png` draws TTFT
and ITL distributions and, for a sweep, throughput against the swept value (bench/plot.py,
needs matplotlib).
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
from typing import Any, NamedTuple

from minisgl.bench import plot
from minisgl.bench.plot import SweepAxis
from minisgl.bench.serve_stats import (  # noqa: F401  (also imported from here)
    RequestResult, RunSummary, Stats, median_run, percentile, report, stats_ms, summarize, sweep_report,
)
from minisgl.bench.serve_workload import (
    PRESETS, BenchRequest, TokenCounter, WorkloadConfig, arrival_offsets, build_workload,
)


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
    return (await run_detailed(config, requests, seed))[0]


async def run_detailed(
    config: ClientConfig, requests: list[BenchRequest], seed: int
) -> tuple[RunSummary, list[RequestResult]]:
    """One run: its summary and every request's own measurements (for plots)."""
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
    return summarize(list(results), duration, [r.output_len for r in requests]), list(results)


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
    p.add_argument("--concurrency", default=None,
                   help="requests in flight at most (default: preset, else 32); a comma list sweeps it")
    p.add_argument("--request-rate", default=None,
                   help="Poisson arrivals per second (default: all at once); a comma list sweeps it")
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
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (one line per swept value) instead of a report")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write TTFT/ITL distributions (and a sweep's throughput) to this PNG; needs matplotlib")
    return p


class SweepPoint(NamedTuple):
    concurrency: int
    request_rate: float | None


def _resolve(args: argparse.Namespace) -> tuple[WorkloadConfig, list[SweepPoint], SweepAxis | None]:
    preset = PRESETS[args.preset] if args.preset else PRESETS["W2"]

    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    workload = WorkloadConfig(
        num_requests=pick(args.num_requests, preset.num_requests),
        min_input=pick(args.min_input, preset.min_input), max_input=pick(args.max_input, preset.max_input),
        output_len=pick(args.output_len, preset.output_len),
        shared_prefix=pick(args.shared_prefix, preset.shared_prefix), seed=args.seed,
    )
    concurrencies: list[int] = _values(args.concurrency, int, "--concurrency") or [preset.concurrency]
    rates: list[float | None] = [*_values(args.request_rate, float, "--request-rate")] or [None]
    if min(concurrencies) < 1 or args.runs < 1 or args.timeout <= 0:
        raise ValueError("--concurrency and --runs must be >= 1, --timeout > 0")
    if any(rate is not None and not rate > 0 for rate in rates):
        raise ValueError("--request-rate must be > 0")
    if len(concurrencies) > 1 and len(rates) > 1:
        raise ValueError("sweep one of --concurrency and --request-rate, not both")
    axis: SweepAxis | None = "concurrency" if len(concurrencies) > 1 else "request_rate" if len(rates) > 1 else None
    return workload, [SweepPoint(c, r) for c in concurrencies for r in rates], axis


def _values(text: str | None, kind: type[int | float], flag: str) -> list[Any]:
    """`4` or `1,2,8`: the values of a flag that may sweep."""
    if text is None:
        return []
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes a number or a comma list of numbers, got {text!r}") from None


def point_label(point: SweepPoint, axis: SweepAxis | None) -> str:
    if axis == "request_rate":
        return f"{point.request_rate:g} req/s"
    return f"concurrency {point.concurrency}"


class PointOutcome(NamedTuple):
    result: dict[str, Any]  # what --json prints for the point
    runs: list[RunSummary]
    median: RunSummary
    requests: list[RequestResult]  # of the median run


def run_point(base: ClientConfig, point: SweepPoint, workloads: list[list[BenchRequest]], first_seed: int,
              where: str) -> PointOutcome:  # fmt: skip
    config = dataclasses.replace(base, concurrency=point.concurrency, request_rate=point.request_rate)
    runs, details = [], []
    for k, requests in enumerate(workloads):
        summary, per_request = asyncio.run(run_detailed(config, requests, first_seed + k))
        runs.append(summary)
        details.append(per_request)
        print(f"[bench] run {k + 1}/{len(workloads)}{where}: {summary.output_tok_s:.1f} output tok/s, "
              f"{summary.failed} failed", file=sys.stderr)
    median = median_run(runs)
    result = {"concurrency": point.concurrency, "request_rate": point.request_rate,
              "runs": [run.to_dict() for run in runs], "median_run": runs.index(median), "median": median.to_dict()}
    return PointOutcome(result, runs, median, details[runs.index(median)])


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        workload, points, axis = _resolve(args)
        extra_body = json.loads(args.extra_body)
        if args.plot:
            plot.pyplot()  # without matplotlib, say so before the benchmark rather than after it
    except (ValueError, RuntimeError) as exc:  # a JSONDecodeError is a ValueError
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
    base = ClientConfig(url, args.model or served_model_name(url), points[0].concurrency, points[0].request_rate,
                        args.timeout, extra_body)  # fmt: skip
    _warm_up(base, args.warmup)
    outcomes: list[PointOutcome] = []
    for p, point in enumerate(points):
        first_seed = args.seed + p * args.runs  # every run of every point gets prompts of its own
        workloads = [build_workload(dataclasses.replace(workload, seed=first_seed + k), counter)
                     for k in range(args.runs)]  # fmt: skip
        outcome = run_point(base, point, workloads, first_seed, f" ({point_label(point, axis)})" if axis else "")
        outcome.result.update({"label": args.label or url, "url": url, "model": base.model, "preset": args.preset,
                               "workload": dataclasses.asdict(workload), "tokenizer": tokenizer})  # fmt: skip
        if axis:
            outcome.result["sweep"] = axis
        outcomes.append(outcome)
    if args.json:
        print("\n".join(json.dumps(o.result) for o in outcomes), flush=True)
    else:
        texts = [report(o.result, o.runs, o.median) for o in outcomes]
        if axis:
            texts.append(sweep_report(axis, [(point_label(pt, axis), o.median) for pt, o in zip(points, outcomes)]))
        print("\n\n".join(texts), flush=True)
    if args.plot:
        series = [_series(point, axis, o) for point, o in zip(points, outcomes)]
        title = f"{args.label or url}  {args.preset or 'custom'}  model={base.model}"
        print(f"[bench] plot: {plot.plot_bench(series, args.plot, title, axis)}", file=sys.stderr)
    return 1 if any(run.failed for o in outcomes for run in o.runs) else 0


def _series(point: SweepPoint, axis: SweepAxis | None, outcome: PointOutcome) -> plot.PlotSeries:
    done = [r for r in outcome.requests if r.ok]
    x = point.request_rate if axis == "request_rate" and point.request_rate is not None else point.concurrency
    return plot.PlotSeries(point_label(point, axis), float(x), tuple(r.ttft for r in done if r.ttft is not None),
                           tuple(gap for r in done for gap in r.itls), outcome.median.output_tok_s,
                           outcome.median.request_s)  # fmt: skip
