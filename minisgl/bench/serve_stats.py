"""What the serving benchmark measures of each request, the statistics of a run, and its report."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

UsageSource = Literal["usage", "chunks"]


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


# ---------------------------------------------------------------------------------------------
# Statistics


class Stats(NamedTuple):
    mean: float
    p50: float
    p90: float
    p99: float


def percentile(values: Sequence[float], q: float) -> float:
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
# Report


def _fmt(stats: Stats | None) -> str:
    return "     n/a" if stats is None else "".join(f"{v:9.1f}" for v in stats)


def report(result: dict[str, Any], runs: list[RunSummary], median: RunSummary) -> str:
    work = result["workload"]
    prefix = f"{work['shared_prefix']}-token shared prefix + " if work["shared_prefix"] else ""
    lines = [(f"{result['label']} {result['preset'] or 'custom'} @ {result['url']}  model={result['model']}  "
              f"tokenizer={result['tokenizer']}"),
             (f"{work['num_requests']} requests, concurrency {result['concurrency']}, {prefix}"
              f"{work['min_input']}-{work['max_input']} input tokens, {work['output_len']} output tokens")]
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


def sweep_report(axis: str, points: list[tuple[str, RunSummary]]) -> str:
    """One line per swept value: the median run's throughput and latencies (ms)."""
    lines = [f"sweep over {axis.replace('_', ' ')} (median runs)",
             f"{'':18}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"]
    for label, run in points:
        ttft, itl = run.ttft_ms, run.itl_ms
        lines.append(f"{label:18}{run.output_tok_s:9.1f}{run.request_s:8.2f}"
                     f"{_ms(ttft, 'p50'):>10}{_ms(ttft, 'p99'):>10}{_ms(itl, 'p50'):>9}{_ms(itl, 'p99'):>9}")
    return "\n".join(lines)


def _ms(stats: Stats | None, key: str) -> str:
    return "n/a" if stats is None else f"{getattr(stats, key):.1f}"
