"""Is a decode step bound by the host or the GPU? `python scripts/profile_host_steps.py MODEL BS PROMPT [T]`

Times the host side of each part of a step (wall clock around the Python calls; device work is
asynchronous, so on CUDA these are the costs of planning and enqueueing) and the wall time per
step. When the host's total per step is close to the wall time per step, the GPU waits on Python.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import torch

import minisgl.engine.engine as engine_mod
import minisgl.scheduler.scheduler as scheduler_mod
from minisgl import LLM, SamplingParams

totals: collections.Counter[str] = collections.Counter()


def timed(cls: Any, name: str, label: str) -> None:
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(cls, name, wrapper)


for cls, name in [
    (scheduler_mod.Scheduler, "step"), (scheduler_mod.Scheduler, "_plan"), (scheduler_mod.Scheduler, "_advance"),
    (scheduler_mod.Scheduler, "_complete"), (engine_mod.Engine, "launch"), (engine_mod.Engine, "_build"),
    (engine_mod.Engine, "forward_logits"), (engine_mod.Sampler, "sample"), (engine_mod.SamplingBatch, "build"),
    (engine_mod.LaunchedStep, "result"),
]:  # fmt: skip
    timed(cls, name, f"{cls.__name__}.{name}")

model, bs, prompt_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.6
cuda = torch.cuda.is_available()
llm = LLM(model, dummy_weights=True, device="cuda" if cuda else "cpu", max_running_requests=max(bs, 8), cuda_graph_max_bs=max(bs, 8))
prompts = [[(7 * i + j) % 10000 for j in range(prompt_len)] for i in range(bs)]


def run(steps: int) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=steps), use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


run(8)
short = run(8)
totals.clear()
steps = 136
long = run(steps)
per_step = (long - short) / (steps - 8) * 1e3
print(f"bs={bs} prompt={prompt_len} T={temperature}: {per_step:.3f} ms per decode step (wall)")
print("host time per step (averaged over all steps of the long run, prefill included):")
for label, seconds in totals.most_common():
    print(f"  {label:28} {seconds / steps * 1e3:8.3f} ms")
