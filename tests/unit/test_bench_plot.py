"""`python -m minisgl.bench serve --plot`: the PNG of TTFT/ITL distributions and of a sweep's
throughput (bench/plot.py), drawn from synthetic measurements and from a sweep against the fake
streaming server of test_bench_serve.py; the image is opened and its pixels looked at."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from minisgl.bench import serve
from minisgl.bench.plot import PlotSeries, plot_bench
from tests.unit.test_bench_serve import _handler

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")



def drawn(path: Path) -> tuple[tuple[int, int], float, int]:
    """(size, fraction of pixels that are not white, bluish pixels) of a PNG: the histograms
    and the throughput line are blue (#4c78a8), text and axes grey."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        rgb = np.asarray(image.convert("RGB"), dtype=np.int32)
    height, width, _ = rgb.shape
    inked = float((rgb != 255).any(axis=2).mean())
    blue = int((rgb[..., 2] - rgb[..., 0] > 40).sum())
    return (width, height), inked, blue


def series(label: str, x: float, rng: random.Random, scale: float) -> PlotSeries:
    return PlotSeries(label, x, tuple(rng.expovariate(10 / scale) for _ in range(30)),
                      tuple(rng.gauss(0.02 * scale, 0.002) for _ in range(300)), 100 * scale**0.7, scale)  # fmt: skip


def test_single_setting_plot(tmp_path: Path) -> None:
    out = plot_bench([series("concurrency 4", 4, random.Random(0), 4)], tmp_path / "one.png", "one setting")
    size, inked, blue = drawn(out)
    assert size == (1100, 460)  # two panels: TTFT and ITL, each a histogram with its CDF
    assert 0.03 < inked < 0.9 and blue > 2000


def test_sweep_plot_has_a_throughput_panel(tmp_path: Path) -> None:
    rng = random.Random(1)
    points = [series(f"{rate:g} req/s", rate, rng, rate) for rate in (0.5, 1, 2, 4)]
    out = plot_bench(points, tmp_path / "sweep.png", "a sweep", "request_rate")
    size, inked, _ = drawn(out)
    assert size == (1600, 460) and 0.03 < inked < 0.9
    with pytest.raises(ValueError):
        plot_bench([], tmp_path / "none.png", "nothing")


def test_plot_with_no_samples_still_draws(tmp_path: Path) -> None:
    empty = PlotSeries("concurrency 1", 1, (), (), 0.0, 0.0)
    size, inked, _ = drawn(plot_bench([empty], tmp_path / "empty.png", "all requests failed"))
    assert size == (1100, 460) and inked > 0.01


@pytest.fixture
def fake_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(with_usage=True))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_cli_sweep_writes_json_lines_and_a_plot(fake_url: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    png = tmp_path / "bench.png"
    code = serve.main(["--url", fake_url, "--num-requests", "6", "--concurrency", "1,3", "--min-input", "8",
                       "--max-input", "16", "--output-len", "5", "--tokenizer", "server", "--json",
                       "--plot", str(png)])  # fmt: skip
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["concurrency"] for line in lines] == [1, 3] and all(line["sweep"] == "concurrency" for line in lines)
    assert all(line["median"]["completed"] == 6 and line["median"]["output_tokens"] == 30 for line in lines)
    size, inked, blue = drawn(png)
    assert size == (1600, 460) and inked > 0.03 and blue > 500


def test_cli_text_report_of_a_rate_sweep(fake_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = serve.main(["--url", fake_url, "--num-requests", "3", "--request-rate", "50,100", "--min-input", "4",
                       "--max-input", "8", "--output-len", "3", "--tokenizer", "server"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "sweep over request rate (median runs)" in out
    assert out.count("median run:") == 2 and "50 req/s" in out and "100 req/s" in out


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "1,2", "--request-rate", "1,2"], "not both"),
    (["--concurrency", "1,x"], "comma list"),
    (["--request-rate", "0"], "> 0"),
    (["--concurrency", "0,2"], ">= 1"),
])  # fmt: skip
def test_cli_rejects_bad_sweeps(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.main(["--url", "http://127.0.0.1:9", *flags]) == 2
    assert message in capsys.readouterr().err
