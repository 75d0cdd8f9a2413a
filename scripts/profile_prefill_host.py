"""Where does the host time of prefill steps go? (CUDA: prefill steps run eagerly, not in graphs.)

    python scripts/profile_prefill_host.py [MODEL] [extra `minisgl.bench offline` args...]

Prefills the issue's 256 prompts (one output token each, so nearly every step is a prefill chunk)
after a warm-up, under cProfile, and prints the functions with the most own time and the most
cumulative time. When the host's time per step exceeds the GPU's, the GPU idles between kernels.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from minisgl import SamplingParams
from minisgl.bench.offline import profiling_setup


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    args, prompts, _, llm = profiling_setup(sys.argv[1:])
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1)
    llm.generate(prompts[:64], params, use_tqdm=False)  # warm-up: compiles, allocator
    sync()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate([[t + 1 for t in p] for p in prompts], params, use_tqdm=False)  # shifted: no cache hits
    profiler.disable()
    sync()
    tokens = sum(len(p) for p in prompts)
    print(f"prefill of {tokens} tokens in {time.perf_counter() - start:.3f} s (under cProfile)")
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(28)
        print(out.getvalue()[-9000:])


if __name__ == "__main__":
    main()
