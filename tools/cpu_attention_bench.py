"""CPU decode attention microbenchmark: `python tools/cpu_attention_bench.py` (bf16, SmolLM2's
heads: 3 KV heads x 3 q heads, head_dim 64; 32 requests of 128-640 tokens on 16-token pages
scattered over a 64k-slot pool). Prints us per layer call and the K/V bytes read per second.

Research tool, not product code. Findings: docs/performance.md, section "C++ decode attention on
CPU".
"""

from __future__ import annotations

import random
import time

import torch

from minisgl.kernels import cpu_attention

BATCH, KV_HEADS, GROUP, HEAD_DIM, SLOTS, PAGE = 32, 3, 3, 64, 65536, 16


def main() -> None:
    if cpu_attention.load() is None:
        raise SystemExit("the C++ kernel could not be built here")
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(128, 640) for _ in range(BATCH)]
    k = torch.randn(SLOTS, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    v = torch.randn(SLOTS, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    table = torch.zeros(BATCH, 1024, dtype=torch.int32)
    pages, used = torch.randperm(SLOTS // PAGE), 0
    for i, n in enumerate(lens):
        count = -(-n // PAGE)
        slots = (pages[used : used + count, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]
        used += count
        table[i, :n] = slots.int()
    rows = torch.arange(BATCH)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(BATCH, KV_HEADS * GROUP, HEAD_DIM).to(torch.bfloat16)

    def call() -> torch.Tensor:
        return cpu_attention.decode_attention(q, k, v, table, rows, seq_lens, HEAD_DIM**-0.5)

    call()
    runs = 50
    start = time.perf_counter()
    for _ in range(runs):
        call()
    seconds = (time.perf_counter() - start) / runs
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2
    print(f"{BATCH} requests, mean length {sum(lens) / BATCH:.0f}: {seconds * 1e6:.0f} us per layer call, "
          f"K/V read at {kv_bytes / seconds / 1e9:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
