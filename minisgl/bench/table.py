"""Markdown table from the JSON lines that `python -m minisgl.bench serve --json` printed, one row
per (workload, server), using each line's median run.

    python -m minisgl.bench table results.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = ("workload", "server", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
           "E2E p50", "E2E p99", "ok/failed", "runs (out tok/s)")


def _ms(stats: dict[str, float] | None, key: str) -> str:
    return "n/a" if stats is None else f"{stats[key]:.0f}"


def row(result: dict[str, Any]) -> list[str]:
    median = result["median"]
    counted = "" if median["usage_source"] == "usage" else f" ({median['usage_source']})"
    short = f", {median['short_outputs']} short" if median["short_outputs"] else ""
    return [
        result["preset"] or "custom", result["label"], f"{median['output_tok_s']:.1f}{counted}",
        _ms(median["ttft_ms"], "p50"), _ms(median["ttft_ms"], "p99"),
        _ms(median["itl_ms"], "p50"), _ms(median["itl_ms"], "p99"), _ms(median["tpot_ms"], "p50"),
        _ms(median["e2e_ms"], "p50"), _ms(median["e2e_ms"], "p99"),
        f"{median['completed']}/{median['failed']}{short}",
        " / ".join(f"{run['output_tok_s']:.1f}" for run in result["runs"]),
    ]


def table(results: list[dict[str, Any]]) -> str:
    results = sorted(results, key=lambda r: (r["preset"] or "", 0))  # stable: server order kept per workload
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(result)) + " |" for result in results]
    errors = [f"- {r['preset']} {r['label']}: {e}" for r in results for e in r["median"]["errors"]]
    if errors:
        lines += ["", "Errors seen in median runs:", *errors]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    text = Path(argv[0]).read_text()
    results = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    print(table(results))
    return 0
