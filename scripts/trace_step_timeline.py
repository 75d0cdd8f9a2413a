"""Host and GPU timeline of the offline workload's first steps: who waits for whom.

    python scripts/trace_step_timeline.py [MODEL] [extra `minisgl.bench offline` args...]   (CUDA only)

Runs the issue's workload once (after `profiling_setup`'s warm-up) with CUDA events recorded
around every launched step, and host clocks around the scheduler's phases. For the first
STEPS steps (env, default 30) it prints, in ms on one clock (host times mapped onto the GPU's):
- host: when planning began, how long planning, building + launching, and waiting for the
  previous step took;
- gpu: when the step's first queued work could start, when its last work ended, and the idle
  time of the GPU before it (the previous step ended and this step had not been queued yet),
  and the lag: how long after the host's last launch of the step the GPU finished it (near 0:
  the GPU had caught up with the host inside the step).
A step whose GPU idle is large was launched late: the host's planning or launching is the limit
there. Then totals over the first STEPS steps and over the whole run. With PROFILE=A-B (steps),
torch.profiler also records those steps' host side: the CUDA runtime calls that took the most
host time (a launch that blocks, a synchronize, a host allocation) are printed last.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import minisgl.engine.engine as engine_mod
import minisgl.scheduler.scheduler as scheduler_mod
from minisgl import SamplingParams
from minisgl.bench.offline import profiling_setup


def main() -> None:
    args, prompts, outputs, llm = profiling_setup(sys.argv[1:])
    show = int(os.environ.get("STEPS", "30"))
    Scheduler, Engine = scheduler_mod.Scheduler, engine_mod.Engine
    orig_step, orig_plan, orig_launch = Scheduler.step, Scheduler._plan, Engine.launch
    rows: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    first, last = (int(x) for x in os.environ.get("PROFILE", "-1").split("-")) if "PROFILE" in os.environ else (-1, -1)
    prof: dict[str, Any] = {}

    def step(self: Any) -> Any:
        n = len(rows)
        if n == first:
            prof["p"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True)
            prof["p"].__enter__()
        current.clear()
        current["t_begin"] = time.perf_counter()
        out = orig_step(self)
        if n == last and "p" in prof:
            torch.cuda.synchronize()
            prof["p"].__exit__(None, None, None)
            prof["path"] = os.path.join(tempfile.gettempdir(), "timeline_trace.json")
            prof["p"].export_chrome_trace(prof["path"])
            del prof["p"]
        current["t_end"] = time.perf_counter()
        if "ev_start" in current:
            rows.append(dict(current))
        return out

    def plan(self: Any) -> Any:
        result = orig_plan(self)
        current["t_planned"] = time.perf_counter()
        if result is not None:
            current["tokens"] = len(result.out_loc)
            current["reqs"] = len(result.reqs)
        return result

    def launch(self: Any, plan_: Any, prev: Any = None) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = orig_launch(self, plan_, prev)
        end.record()
        current["t_launched"] = time.perf_counter()
        current["ev_start"], current["ev_end"] = start, end
        return out

    Scheduler.step, Scheduler._plan, Engine.launch = step, plan, launch  # type: ignore[method-assign]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]
    base = torch.cuda.Event(enable_timing=True)
    base.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3

    def host(t: float) -> float:
        return (t - t0) * 1e3

    print(f"{'step':>4} {'tok':>6} {'reqs':>4} | {'plan@':>8} {'plan':>6} {'launch':>6} {'wait':>6} | "
          f"{'gpu start':>9} {'gpu end':>9} {'gpu ms':>7} {'idle':>6} {'lag':>6}")  # fmt: skip
    prev_end = 0.0
    idle_total = idle_shown = 0.0
    for i, r in enumerate(rows):
        g_start, g_end = base.elapsed_time(r["ev_start"]), base.elapsed_time(r["ev_end"])
        idle = max(0.0, g_start - prev_end) if i else 0.0
        idle_total += idle
        if i < show:
            idle_shown += idle
            plan_ms = host(r["t_planned"]) - host(r["t_begin"])
            launch_ms = host(r["t_launched"]) - host(r["t_planned"])
            wait_ms = host(r["t_end"]) - host(r["t_launched"])
            print(f"{i:>4} {r.get('tokens', 0):>6} {r.get('reqs', 0):>4} | {host(r['t_begin']):>8.2f} {plan_ms:>6.2f} "
                  f"{launch_ms:>6.2f} {wait_ms:>6.2f} | {g_start:>9.2f} {g_end:>9.2f} {g_end - g_start:>7.2f} "
                  f"{idle:>6.2f} {g_end - host(r['t_launched']):>6.2f}")  # fmt: skip
        prev_end = g_end
    print(f"first {min(show, len(rows))} steps: GPU idle between steps {idle_shown:.1f} ms; "
          f"whole run: {len(rows)} steps, {wall:.0f} ms, GPU idle between steps {idle_total:.1f} ms")
    bands: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        reqs, tokens = r.get("reqs", 0), r.get("tokens", 0)
        band = "prefill" if tokens > reqs else next(
            f"decode {lo}-{hi}" for lo, hi in ((1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 10**6))
            if lo <= reqs <= hi)  # fmt: skip
        b = bands[band]
        b[0] += 1
        b[1] += base.elapsed_time(r["ev_end"]) - base.elapsed_time(r["ev_start"])
        b[2] += reqs if tokens == reqs else 0
    print("by step kind (requests in the step): steps, GPU ms, ms per step, output tokens")
    for band, (n, ms, toks) in sorted(bands.items()):
        print(f"   {band:16} {n:>5} {ms:9.1f} {ms / n:7.2f} {int(toks):>8}")
    if "path" in prof:
        runtime_calls(prof["path"], f"steps {first}-{last}")


def runtime_calls(path: str, label: str) -> None:
    """Where the host blocked (the CUDA calls and ops that took long, with their Python stacks),
    and what the GPU waited for (its longest idle gaps, with the host stack that launched the
    work after each)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = calls[e["name"]]
            c[0] += 1
            c[1] += e["dur"]
            c[2] = max(c[2], e["dur"])
    print(f"== CUDA runtime calls, {label}: host ms in total, count, longest us")
    for name, (n, total, longest) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"   {total / 1e3:8.2f} ms {n:>7}x  longest {longest:9.1f} us  {name}")
    python = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: e["ts"])

    def stack(e: dict[str, Any]) -> str:
        """The innermost minisgl frames around host event `e`."""
        t = e["ts"]
        frames = [p for p in python if p["tid"] == e["tid"] and p["ts"] <= t <= p["ts"] + p["dur"]]
        frames.sort(key=lambda p: (p["ts"], -p["dur"]))
        names = [p["name"].split("/")[-1] for p in frames if "minisgl" in p["name"] or "scripts" in p["name"]]
        return " > ".join(names[-5:])

    ops = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime") and e["dur"] > 1000]
    print("   host calls over 1 ms (outermost), with their stacks:")
    seen = set()
    for e in sorted(ops, key=lambda e: e["ts"]):
        if any(e["ts"] >= a and e["ts"] + e["dur"] <= b for a, b in seen):
            continue  # inside one printed already
        seen.add((e["ts"], e["ts"] + e["dur"]))
        print(f"   {e['dur'] / 1e3:7.2f} ms {e['name'][:32]:32} {stack(e)}")
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "args" in e}
    gaps = []
    for a, b in zip(device, device[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 200:
            gaps.append((gap, a, b))
    print("   GPU gaps over 0.2 ms (the host launched the next op late), longest first:")
    for gap, a, b in sorted(gaps, key=lambda g: -g[0])[:12]:
        launch = launches.get(b.get("args", {}).get("correlation"))
        where = stack(launch) if launch else "?"
        print(f"   {gap / 1e3:7.2f} ms  {a['name'][:28]} -> {b['name'][:28]}  launched from {where}")


if __name__ == "__main__":
    main()
