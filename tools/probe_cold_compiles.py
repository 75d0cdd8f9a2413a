"""Which Triton kernel variants does the offline benchmark first need inside its timed run? On a
fresh machine each one is a compile of ~0.2-2 s inside the measurement. `python
tools/probe_cold_compiles.py [bench args...]` (default: the issue's workload on
configs/qwen3-0.6b, dummy weights): builds and warms the engine as `bench offline` does, then runs
the workload with Triton's JIT cache hook recording every in-memory cache miss (kernel, the
specialisation key, when). Set TRITON_CACHE_DIR to an empty directory to time cold compiles.

Research tool, not product code. Findings: docs/performance.md, section "No compiles mid-run".
"""

from __future__ import annotations

import sys
import time

import triton.knobs

from minisgl import SamplingParams
from minisgl.bench.offline import build_parser, make_llm, make_workload

DEFAULT = ("--model configs/qwen3-0.6b --dummy-weights --num-seqs 256 --min-input 100 --max-input 1024 "
           "--min-output 100 --max-output 1024 --seed 0").split()  # fmt: skip


def main() -> None:
    args = build_parser().parse_args(sys.argv[1:] or DEFAULT)
    prompts, outputs = make_workload(args)
    llm, _store = make_llm(args)
    misses: list[tuple[float, str, str]] = []
    start = time.perf_counter()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        misses.append((time.perf_counter() - start, fn.name, str(key)[:160]))
        return False  # compile as usual

    triton.knobs.runtime.jit_cache_hook = hook
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    triton.knobs.runtime.jit_cache_hook = None
    print(f"timed run: {seconds:.2f} s, {len(misses)} Triton variants first needed inside it")
    for at, name, key in misses:
        print(f"  at {at:7.3f} s  {name}  {key}")


if __name__ == "__main__":
    main()
