"""Where does a prefill step's GPU time go? `python scripts/profile_gpu_prefill.py [num_prompts] [prompt_len]`

Qwen3-0.6B shape, dummy weights, no prefix cache (every prompt computed in full): prints the wall
time of prefilling `num_prompts` prompts (one step when they fit in --max-prefill-tokens, 8192 by
default) and the top GPU kernels of one such prefill under torch.profiler."""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams

num, length = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16, 512)
llm = LLM("configs/qwen3-0.6b", dummy_weights=True, cache="naive")
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)


def prompts(seed: int) -> list[list[int]]:
    return [[(seed * 7919 + 31 * i + 17 * j) % 10000 for j in range(length)] for i in range(num)]


for seed in range(3):  # warm-up: compiles, allocator
    llm.generate(prompts(seed), params, use_tqdm=False)
torch.cuda.synchronize()
start = time.perf_counter()
llm.generate(prompts(5), params, use_tqdm=False)
torch.cuda.synchronize()
print(f"prefill {num} x {length} tokens: {(time.perf_counter() - start) * 1e3:.2f} ms wall")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts(6), params, use_tqdm=False)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
