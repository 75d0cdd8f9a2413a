"""Pictures of a serving benchmark (`python -m minisgl.bench serve ... --plot out.png`).

One PNG: the distribution of time to first token and of inter-token latency (a histogram with
its CDF for a single setting; one CDF per setting when the run sweeps concurrency or request
rate), and, for a sweep, output throughput and median/p99 TTFT against the swept value.

matplotlib is imported only here and only when a plot is asked for (the `test` extra installs
it), so the benchmark and the server never need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from minisgl.bench.serve_stats import percentile

SweepAxis = Literal["concurrency", "request_rate"]
AXIS_LABELS: dict[str, str] = {"concurrency": "concurrency (requests in flight)", "request_rate": "request rate (req/s)"}


@dataclass(frozen=True)
class PlotSeries:
    """One benchmark setting: its label, the swept value, and the median run's measurements."""

    label: str
    x: float
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    output_tok_s: float
    request_s: float


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend, or a clear error without matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or the test extra)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bench(series: Sequence[PlotSeries], path: str | Path, title: str, axis: SweepAxis | None = None) -> Path:
    """Write the benchmark's PNG to `path`; `axis` names the swept setting (None: one setting)."""
    if not series:
        raise ValueError("nothing to plot: no benchmark settings")
    plt = pyplot()
    sweep = axis is not None and len(series) > 1
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(16 if sweep else 11, 4.6), dpi=100)
    try:
        for ax, name, key in ((axes[0], "time to first token", "ttft_s"), (axes[1], "inter-token latency", "itl_s")):
            if sweep:
                _cdfs(ax, [(s.label, [v * 1000 for v in getattr(s, key)]) for s in series], name)
            else:
                _histogram(ax, [v * 1000 for v in getattr(series[0], key)], name)
        if sweep:
            assert axis is not None
            _throughput(axes[2], series, axis)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out


def _cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def _histogram(ax: Any, values_ms: list[float], name: str) -> None:
    ax.set_title(f"{name} ({len(values_ms)} samples)")
    ax.set_xlabel("ms")
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values_ms, bins=min(40, max(5, len(values_ms) // 2)), color="#4c78a8", alpha=0.75)
    ax.set_ylabel("count")
    cdf = ax.twinx()
    xs, ys = _cdf_points(values_ms)
    cdf.plot(xs, ys, color="#e45756", linewidth=1.5, label="CDF")
    cdf.set_ylim(0, 1.02)
    cdf.set_ylabel("fraction ≤ x")
    for q, style in ((50, "--"), (99, ":")):
        value = percentile(values_ms, q)
        ax.axvline(value, color="#333333", linestyle=style, linewidth=1, label=f"p{q} {value:.1f} ms")
    ax.legend(loc="center right", fontsize=8)


def _cdfs(ax: Any, curves: list[tuple[str, list[float]]], name: str) -> None:
    ax.set_title(f"{name} (CDF)")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction ≤ x")
    for label, values in curves:
        if values:
            xs, ys = _cdf_points(values)
            ax.step(xs, ys, where="post", label=label, linewidth=1.5)
    if all(values and min(values) > 0 for _, values in curves) and _spread(curves) > 20:
        ax.set_xscale("log")  # settings whose latencies differ by orders of magnitude
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _spread(curves: list[tuple[str, list[float]]]) -> float:
    values = [v for _, vs in curves for v in vs]
    return max(values) / min(values) if values and min(values) > 0 else 1.0


def _throughput(ax: Any, series: Sequence[PlotSeries], axis: SweepAxis) -> None:
    xs = [s.x for s in series]
    ax.plot(xs, [s.output_tok_s for s in series], marker="o", color="#4c78a8", label="output tok/s")
    ax.set_xlabel(AXIS_LABELS[axis])
    ax.set_ylabel("output tok/s", color="#4c78a8")
    ax.set_title(f"throughput and TTFT against {axis.replace('_', ' ')}")
    ax.grid(alpha=0.3)
    latency = ax.twinx()
    for q, style in ((50, "--"), (99, ":")):
        ttft_ms = [1000 * percentile(s.ttft_s, q) if s.ttft_s else float("nan") for s in series]
        latency.plot(xs, ttft_ms, marker="s", linestyle=style, color="#e45756", label=f"TTFT p{q}")
    latency.set_ylabel("TTFT ms", color="#e45756")
    lines = ax.get_lines() + latency.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
