"""Where does a decode step's GPU time go? `python scripts/profile_gpu_decode.py [batch_size]`:
Qwen3-0.6B shape, dummy weights, a short decode under torch.profiler; prints the top kernels."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams

bs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
llm = LLM("configs/qwen3-0.6b", dummy_weights=True, max_running_requests=max(bs, 8), cuda_graph_max_bs=max(bs, 8))
prompts = [[(7 * i + j) % 10000 for j in range(128)] for i in range(bs)]
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=48)
llm.generate(prompts, params, use_tqdm=False)  # warm-up, compiles
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts, params, use_tqdm=False)
torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
