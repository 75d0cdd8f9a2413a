"""Where does a decode step's time go? `python scripts/profile_gpu_decode.py [bs] [prompt_len]`:
Qwen3-0.6B shape, dummy weights. Prints the wall time of one decode step (difference of two runs
that differ only in output length, so prefill cancels out) and the top GPU kernels of a short
decode under torch.profiler, per step."""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams

bs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 128
llm = LLM("configs/qwen3-0.6b", dummy_weights=True, max_running_requests=max(bs, 8), cuda_graph_max_bs=max(bs, 8))
prompts = [[(7 * i + j) % 10000 for j in range(prompt_len)] for i in range(bs)]


def timed(max_tokens: int) -> float:
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


timed(16)  # warm-up, compiles
short, long = 16, 144
t_short, t_long = min(timed(short) for _ in range(2)), min(timed(long) for _ in range(2))
step_ms = (t_long - t_short) / (long - short) * 1e3
print(f"bs={bs} prompt={prompt_len}: {step_ms:.3f} ms per decode step (wall), {bs / step_ms * 1e3:.0f} tok/s")

steps = 32
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts, params, use_tqdm=False)
torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
total = sum(getattr(e, "self_device_time_total", 0) for e in events)
print(f"GPU time (prefill + {steps} decode steps): {total / 1e3:.2f} ms")
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
