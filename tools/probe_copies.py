"""Which host ops issue the device copies and memsets of a step (eager steps, torch.profiler).

    python tools/probe_copies.py [MODEL] [extra `minisgl.bench offline` args...]

A captured decode step of the folded-norm layer showed a `memcpy32_post` graph node before each
o_proj / down_proj GEMM, and prefill steps showed ~600 device-to-device copies and memsets. This
runs a few eager decode steps (`--cuda-graph-max-bs 0`) and a prefill-only pass under the
profiler, and prints, for every copy/memset kernel, the chain of host ops that launched it.

Research tool, not product code. Findings: docs/performance.md, sections "A cheap step boundary" and
"Folded RMSNorms".
"""

from __future__ import annotations

import collections
import sys

import torch
from _workload import setup  # same directory

from minisgl import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def chain(event) -> str:
    names = []
    while event is not None and len(names) < 7:
        names.append(event.name[:48])
        event = event.cpu_parent
    return " <- ".join(names)


def report(title: str, prof) -> None:
    copies: collections.Counter[str] = collections.Counter()
    for event in prof.profiler.function_events:
        for kernel in getattr(event, "kernels", []):
            name = kernel.name
            if any(s in name.lower() for s in ("memcpy", "memset")):
                copies[f"{name[:24]:24} | {chain(event)}"] += 1
    print(f"== {title}: copy/memset kernels by launching op chain (count)")
    for key, count in copies.most_common(25):
        print(f"  {count:6d}  {key}")


def main() -> None:
    args, prompts, _, llm = setup([*sys.argv[1:], "--cuda-graph-max-bs", "0"])
    warm = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=4)
    llm.generate(prompts[:16], warm, use_tqdm=False)
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate([[t + 3 for t in p] for p in prompts[:16]], warm, use_tqdm=False)
        sync()
    report("16 requests, 4 tokens each (1 prefill step + 3 eager decode steps)", prof)
    one = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1)
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate([[t + 5 for t in p] for p in prompts[:64]], one, use_tqdm=False)
        sync()
    report("64 prompts, prefill only", prof)


if __name__ == "__main__":
    main()
