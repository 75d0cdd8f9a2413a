"""Summaries of a torch.profiler Chrome trace (`prof.export_chrome_trace`), for `bench profile
table`: how busy the device was and where it idled, and which CUDA runtime calls took host time.

Pure functions over the trace's event list (no torch), so they are tested on made-up events."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Gap sizes in us: 1-3 us between the kernels of a replayed graph is launch latency; tens of us or
# more mean the device waited for the host.
GAP_EDGES = (1.0, 2.0, 3.0, 5.0, 10.0, 100.0, float("inf"))

Event = dict[str, Any]


def load_events(path: str | Path) -> list[Event]:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def short_name(name: str) -> str:
    return name.split("(")[0].split("<")[0][:40]


def device_report(events: list[Event], steps: int, top: int = 12) -> list[str]:
    """Device busy time over the traced span, its idle gaps by size, the ops with the most device
    time and the op pairs with the most idle time between them; per step where it says so."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        return ["device: no kernel events in the trace (the CPU runs every op inline on the host)"]
    steps = max(steps, 1)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    busy, end = 0.0, device[0]["ts"]
    bins = [[0, 0.0] for _ in GAP_EDGES]
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    per_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    prev: Event | None = None
    for e in device:
        start, stop = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, stop - max(start, end))
        if prev is not None and start > end:
            gap = start - end
            slot = bins[next(i for i, edge in enumerate(GAP_EDGES) if gap < edge)]
            slot[0] += 1
            slot[1] += gap
            pair = pairs[(short_name(prev["name"]), short_name(e["name"]))]
            pair[0] += 1
            pair[1] += gap
        op = per_op[short_name(e["name"])]
        op[0] += 1
        op[1] += e["dur"]
        end = max(end, stop)
        prev = e
    lines = [f"device: {steps} steps, {len(device)} device ops, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
             f"({busy / span:.1%}), idle {(span - busy) / steps:.0f} us per step"]  # fmt: skip
    low = 0.0
    for edge, (count, total) in zip(GAP_EDGES, bins):
        lines.append(f"  gaps {low:>5.0f}-{edge:<5.0f} us: {int(count):>6} gaps, {total / 1e3:8.2f} ms "
                     f"({total / steps:7.1f} us/step)")  # fmt: skip
        low = edge
    lines.append("  most device time (per step, count, mean):")
    for name, (count, total) in sorted(per_op.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {total / steps:8.1f} us/step {int(count):>6}x {total / count:7.2f} us  {name}")
    lines.append("  most idle time between (previous -> next):")
    for (a, b), (count, total) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {total / steps:8.1f} us/step {int(count):>6}x {total / count:6.2f} us  {a} -> {b}")
    return lines


def runtime_report(events: list[Event], top: int = 12) -> list[str]:
    """The CUDA runtime and driver calls by host time: a launch that blocks, a synchronize (the
    host waiting for the device), a host allocation."""
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("cat") in RUNTIME_CATEGORIES:
            call = calls[e["name"]]
            call[0] += 1
            call[1] += e["dur"]
            call[2] = max(call[2], e["dur"])
    if not calls:
        return []
    lines = ["CUDA runtime calls: host ms in total, count, longest us"]
    for name, (count, total, longest) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {total / 1e3:8.2f} ms {int(count):>7}x  longest {longest:9.1f} us  {name}")
    return lines
