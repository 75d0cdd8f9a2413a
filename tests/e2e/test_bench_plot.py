"""`python -m minisgl.bench serve --plot` against the real server: a concurrency sweep writes one
JSON line per value and a PNG with the TTFT/ITL distributions and the throughput panel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.service import REPO, Server

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")


def test_bench_sweep_plot_against_the_server(server: Server, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "minisgl.bench", "serve", "--url", server.base_url, "--num-requests", "4",
           "--concurrency", "1,2", "--min-input", "8", "--max-input", "24", "--output-len", "6",
           "--tokenizer", "local", "--warmup", "0", "--timeout", "300", "--json", "--plot", str(png)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["concurrency"] for line in lines] == [1, 2]
    for line in lines:
        median = line["median"]
        assert median["completed"] == 4 and median["failed"] == 0 and median["output_tokens"] == 24
        assert median["usage_source"] == "usage" and median["ttft_ms"]["p50"] > 0 and median["itl_ms"]["p50"] > 0
    assert f"[bench] plot: {png}" in done.stderr
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1600, 460)
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # lines, text and fills, not a blank canvas
    white = max(count for count, colour in colours if colour == (255, 255, 255))
    assert white < 0.97 * rgb.size[0] * rgb.size[1]
