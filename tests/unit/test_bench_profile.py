"""`python -m minisgl.bench profile`: every mode on CPU (a tiny model in-process; the embedded
model through the command line), and the Chrome-trace summaries on made-up events."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minisgl.bench.profile import PROFILES, build_parser, drive, step_kind
from minisgl.bench.trace_report import device_report, load_events, runtime_report
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ["--device", "cpu", "--num-seqs", "3", "--min-input", "6", "--max-input", "20", "--min-output", "3",
            "--max-output", "5", "--max-token-id", "500", "--num-pages", "64", "--cuda-graph-max-bs", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[list[int]], list[int]]:
    from minisgl.bench.offline import make_llm, make_workload

    path = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model("qwen3", path)
    args = build_parser().parse_args(["steps", "--model", str(path), *WORKLOAD])
    prompts, outputs = make_workload(args)
    llm, _ = make_llm(args)
    return llm, args, prompts, outputs


def _run(setup: tuple[Any, Any, list[list[int]], list[int]], mode: str, **overrides: Any) -> str:
    llm, args, prompts, outputs = setup
    args = build_parser().parse_args([mode, "--model", args.model, *WORKLOAD])
    for key, value in overrides.items():
        setattr(args, key, value)
    text = "\n".join(PROFILES[mode](llm, args, prompts, outputs))
    assert not llm.scheduler.has_work()
    return text


def test_steps_accounts_for_every_step_and_token(setup: tuple[Any, Any, list[list[int]], list[int]]) -> None:
    text = _run(setup, "steps")
    _, _, _, outputs = setup
    summary = re.search(r"(\d+) steps, (\d+) output tokens", text)
    assert summary is not None, text
    steps, tokens = int(summary[1]), int(summary[2])
    assert tokens == sum(outputs)  # ignore_eos: every request runs to its length
    rows = re.findall(r"^(admit/prefill|decode \S+)\s+(\d+)\s", text, re.M)
    assert rows[0][0] == "admit/prefill"
    assert any(kind.startswith("decode") for kind, _ in rows)
    assert sum(int(n) for _, n in rows) == steps
    assert steps >= max(outputs)  # one token per request per step at most


def test_host_times_minisgl_functions(setup: tuple[Any, Any, list[list[int]], list[int]]) -> None:
    text = _run(setup, "host", rows=40)
    assert "ms per step (wall)" in text
    ours = text.split("minisgl functions by cumulative host time")[1].split("all functions by own host time")[0]
    assert "(minisgl/scheduler/" in ours and "(minisgl/engine/" in ours, ours
    assert "minisgl/bench/profile.py" not in ours  # the driving loop itself is left out


def test_table_whole_run_and_window(setup: tuple[Any, Any, list[list[int]], list[int]], tmp_path: Path) -> None:
    text = _run(setup, "table")
    assert "Self CPU" in text and "aten::" in text
    trace = tmp_path / "trace.json"
    text = _run(setup, "table", window="1-3", trace_out=str(trace))
    assert "profiled steps 1-3" in text
    assert "no kernel events" in text  # CPU: ops run on the host
    assert load_events(trace), "the Chrome trace has no complete events"
    text = _run(setup, "table", window="500-600")
    assert "nothing in --window 500-600" in text


def test_decode_and_prefill_times(setup: tuple[Any, Any, list[list[int]], list[int]]) -> None:
    text = _run(setup, "decode", short=2, long=6, repeat=1)
    match = re.search(r"3 requests, prompts of \d+-\d+ tokens: ([\d.]+) ms per decode step", text)
    assert match is not None and float(match[1]) > 0, text
    _, _, prompts, _ = setup
    text = _run(setup, "prefill", repeat=2)
    assert f"prefill of 3 prompts, {sum(len(p) for p in prompts)} tokens:" in text, text
    with pytest.raises(ValueError, match="--short < --long"):
        _run(setup, "decode", short=6, long=6)


def test_drive_aborts_what_it_queued_on_error(setup: tuple[Any, Any, list[list[int]], list[int]]) -> None:
    from minisgl.core import SamplingParams

    llm, _, prompts, _ = setup

    def fail(n: int) -> None:
        if n == 1:
            assert step_kind(llm.scheduler).startswith(("admit", "decode"))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        drive(llm, prompts, [SamplingParams(ignore_eos=True, max_tokens=4)] * len(prompts), fail)
    llm.scheduler.step()  # lets an in-flight step (overlap) complete
    assert not llm.scheduler.has_work()


def test_parser_refuses_what_profile_cannot_do() -> None:
    from minisgl.bench.profile import main

    bad = (["steps", "--tp", "2"], ["steps", "--peer", "hf"], ["table", "--window", "5-2"], ["nope"],
           ["steps", "--max-input", "64"], ["host", "--min-output", "9", "--max-output", "8"])  # fmt: skip
    for argv in bad:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv


def test_cli_runs_on_cpu_with_the_embedded_model() -> None:
    """The must-show: `python -m minisgl.bench profile` with the default (embedded) model on CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MINISGL_DEFAULT_DTYPE": "float32"}
    argv = ["steps", "--device", "cpu", "--num-seqs", "2", "--min-input", "8", "--max-input", "12",
            "--min-output", "2", "--max-output", "3"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "minisgl.bench", "profile", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== profile steps: the embedded model on cpu" in proc.stdout
    assert re.search(r"^admit/prefill\s+\d+", proc.stdout, re.M), proc.stdout


# --------------------------------------------------------------------------- trace summaries


def _kernel(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_device_report_busy_share_and_gaps() -> None:
    # busy 0-10, 12-20 (gap 2 us), 120-130 (gap 100 us), one overlapping copy inside the first
    events = [_kernel("gemm<1>(x)", 0, 10), {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 2, "dur": 3},
              _kernel("rotary", 12, 8), _kernel("gemm<1>(x)", 120, 10),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]  # fmt: skip
    lines = device_report(events, steps=2)
    assert lines[0].startswith("device: 2 steps, 4 device ops, span 0.13 ms, busy 0.03 ms (21.5%)"), lines[0]
    gaps = {" ".join(line.split(":")[0].split()): int(line.split(":")[1].split()[0]) for line in lines if " us: " in line}
    assert gaps == {"gaps 0-1 us": 0, "gaps 1-2 us": 0, "gaps 2-3 us": 1, "gaps 3-5 us": 0, "gaps 5-10 us": 0,
                    "gaps 10-100 us": 0, "gaps 100-inf us": 1}, gaps  # fmt: skip
    assert any("rotary -> gemm" in line for line in lines)
    assert any(line.endswith("  gemm") and "2x" in line for line in lines)
    assert device_report([events[-1]], steps=1)[0].startswith("device: no kernel events")


def test_runtime_report_sums_host_calls(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": i, "dur": 4.0} for i in range(3)]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 9, "dur": 2500.0})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [*events, {"ph": "M", "name": "process_name"}]}))
    loaded = load_events(path)
    assert len(loaded) == 4
    lines = runtime_report(loaded)
    assert "cudaEventSynchronize" in lines[1] and "2.50 ms" in lines[1]
    assert "3x" in lines[2] and "cudaLaunchKernel" in lines[2]
    assert runtime_report([_kernel("k", 0, 1)]) == []
