"""Host time at the two ends of the offline benchmark's timed region: from `LLM.generate()` to the
first step's launch (encoding, checking and queueing prompts, planning the first step), and from
the last launch to `generate()` returning. Everything between overlaps with the device's steps.
With FIRST_ONLY=1 it stops at the first launch (aborting the requests): a large model on a CPU.

    python scripts/probe_host_start.py [minisgl.bench offline args]   (any device; the bench's defaults)

e.g. `python scripts/probe_host_start.py --model configs/qwen3-0.6b --dummy-weights --num-seqs 256
--min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0`.
"""

from __future__ import annotations

import os
import sys
import time

import minisgl.engine.engine as engine_mod
from minisgl import SamplingParams
from minisgl.bench.offline import build_parser, make_llm, make_workload


def main() -> None:
    args = build_parser().parse_args(sys.argv[1:])
    prompts, outputs = make_workload(args)
    llm, _ = make_llm(args)
    launches: list[float] = []
    launch = engine_mod.Engine.launch

    class FirstLaunch(Exception):
        pass

    def timed_launch(self, plan, prev=None):  # type: ignore[no-untyped-def]
        launches.append(time.perf_counter())
        if os.environ.get("FIRST_ONLY") == "1":
            raise FirstLaunch
        return launch(self, plan, prev)

    engine_mod.Engine.launch = timed_launch  # type: ignore[method-assign]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]
    llm.engine.platform.synchronize()
    start = time.perf_counter()
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    except FirstLaunch:
        print(f"{len(prompts)} prompts: {1e3 * (launches[0] - start):.1f} ms to the first launch")
        return
    llm.engine.platform.synchronize()
    end = time.perf_counter()
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    print(f"{len(prompts)} prompts, {tokens} output tokens, {len(launches)} steps in {end - start:.3f} s: "
          f"{1e3 * (launches[0] - start):.1f} ms to the first launch, {1e3 * (end - launches[-1]):.1f} ms after "
          f"the last")  # fmt: skip


if __name__ == "__main__":
    main()
