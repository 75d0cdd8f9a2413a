"""Where is the GPU idle during the offline workload? Kernel timeline gaps from torch.profiler.

    python scripts/trace_gaps.py [MODEL] [extra `minisgl.bench offline` args...]      (CUDA only)

Runs the issue's workload and traces two windows of scheduler steps: the start (prefill chunks
with decodes riding along) and a stretch of pure decode in the middle. For each window it prints
how much of the span the GPU was busy, the gaps between consecutive device operations by size
(a gap of 1-3 us between kernels of a replayed graph is launch latency; tens of us or more mean
the GPU waited for the host), and the kernel pairs with the most gap time between them.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import minisgl.scheduler.scheduler as scheduler_mod
from minisgl import SamplingParams
from minisgl.bench.offline import profiling_setup

WINDOWS = {"start (prefill)": (0, 24), "decode, steps 400-411": (400, 412)}
BINS = (1.0, 2.0, 3.0, 5.0, 10.0, 100.0, float("inf"))


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:40]


def analyse(label: str, trace_path: str, steps: int) -> None:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
        key=lambda e: e["ts"],
    )
    if not device:
        print(f"== {label}: no device events")
        return
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    busy, end = 0.0, device[0]["ts"]
    bins = [[0, 0.0] for _ in BINS]
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    prev = None
    for e in device:
        start, stop = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, stop - max(start, end))
        if prev is not None:
            gap = start - end
            if gap > 0:
                b = bins[next(i for i, edge in enumerate(BINS) if gap < edge)]
                b[0] += 1
                b[1] += gap
                p = pairs[(short(prev["name"]), short(e["name"]))]
                p[0] += 1
                p[1] += gap
        end = max(end, stop)
        prev = e
    print(f"== {label}: {steps} steps, {len(device)} device ops, span {span / 1e3:.2f} ms, "
          f"busy {busy / 1e3:.2f} ms ({busy / span:.1%}), idle {(span - busy) / steps:.0f} us per step")  # fmt: skip
    lo = 0.0
    for edge, (n, total) in zip(BINS, bins):
        print(f"   gaps {lo:>5.0f}-{edge:<5.0f} us: {n:>6} gaps, {total / 1e3:8.2f} ms ({total / steps:7.1f} us/step)")
        lo = edge
    per_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in device:
        k = per_kernel[short(e["name"])]
        k[0] += 1
        k[1] += e["dur"]
    print("   most device time (per step, count, mean):")
    for name, (n, total) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"   {total / steps:7.1f} us/step {n:>6}x {total / n:7.2f} us  {name}")
    print("   most gap time between (previous -> next):")
    for (a, b), (n, total) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"   {total / steps:7.1f} us/step {n:>6}x {total / n:6.2f} us  {a} -> {b}")


def main() -> None:
    args, prompts, outputs, llm = profiling_setup(sys.argv[1:])
    original_step = scheduler_mod.Scheduler.step
    state: dict[str, Any] = {"n": 0, "prof": None}
    traces: list[tuple[str, str, int]] = []

    def step(self: Any) -> Any:
        n = state["n"]
        for label, (first, last) in WINDOWS.items():
            if n == first:
                state["prof"] = profile(activities=[ProfilerActivity.CUDA])  # no host op tracing: it would slow the host
                state["prof"].__enter__()
            if n == last and state["prof"] is not None:
                torch.cuda.synchronize()
                prof, state["prof"] = state["prof"], None
                prof.__exit__(None, None, None)
                path = os.path.join(tempfile.gettempdir(), f"trace_{first}.json")
                prof.export_chrome_trace(path)
                traces.append((label, path, last - first))
        state["n"] = n + 1
        return original_step(self)

    scheduler_mod.Scheduler.step = step  # type: ignore[method-assign]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]
    llm.generate(prompts, params, use_tqdm=False)
    for label, path, steps in traces:
        analyse(label, path, steps)


if __name__ == "__main__":
    main()
