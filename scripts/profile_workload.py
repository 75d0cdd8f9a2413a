"""Where the wall time of the whole offline benchmark goes, by batch size.

    python scripts/profile_workload.py [MODEL] [extra `minisgl.bench offline` args...]

Runs the issue's workload (256 sequences, lengths uniform in [100, 1024], seed 0, T=0.6) through
`LLM.generate` and times every `Scheduler.step`: its wall time, the part spent blocked on the
device (`LaunchedStep.result`) and the part spent planning/launching on the host. Steps are
bucketed by the number of requests in the launched batch, and prefill-carrying steps apart. Where
the host part is close to the wall time of a bucket, that bucket is bound by Python, not the GPU.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import torch

import minisgl.engine.engine as engine_mod
import minisgl.scheduler.scheduler as scheduler_mod
from minisgl import SamplingParams
from minisgl.bench.offline import profiling_setup

waits: list[float] = []
_result = engine_mod.LaunchedStep.result


def _timed_result(self: Any, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    try:
        return _result(self, *args, **kwargs)
    finally:
        waits.append(time.perf_counter() - start)


engine_mod.LaunchedStep.result = _timed_result  # type: ignore[method-assign]


def main() -> None:
    args, prompts, outputs, llm = profiling_setup(sys.argv[1:])
    sched = llm.scheduler
    buckets: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])  # steps, wall, wait
    original_step = scheduler_mod.Scheduler.step

    def step(self: Any) -> Any:
        before = len(waits)
        prefill = any(req.extend_len > 1 or req.cached_len < req.prompt_len for req in self.running) or bool(self.waiting)
        size = len(self.running)
        start = time.perf_counter()
        out = original_step(self)
        wall = time.perf_counter() - start
        wait = sum(waits[before:])
        key = "prefill" if prefill else f"decode {min(256, 32 * ((size + 31) // 32)):>3}"
        b = buckets[key]
        b[0] += 1
        b[1] += wall
        b[2] += wait
        return out

    scheduler_mod.Scheduler.step = step  # type: ignore[method-assign]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    print(f"{tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s; {sched.num_retractions} retractions")
    print(f"{'bucket (batch <=)':18} {'steps':>6} {'wall s':>7} {'ms/step':>8} {'wait ms':>8} {'host ms':>8}")
    for key in sorted(buckets):
        n, wall, wait = buckets[key]
        print(f"{key:18} {n:>6} {wall:>7.2f} {wall / n * 1e3:>8.3f} {wait / n * 1e3:>8.3f} {(wall - wait) / n * 1e3:>8.3f}")


if __name__ == "__main__":
    main()
