"""The fused expert GEMMs' tiles at Qwen3-30B-A3B's expert shape (issue 28): `moe.run_experts`
(align + gate_up + down + the top-k sum) timed per tiling (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages) at the issue-10 workload's per-expert batch sizes, beside the default `moe._tiling` pick:
decode steps of 64 and 256 sequences (4 and 16 rows per expert: 256 x 8 / 128), a mid-size
mixed step (1024 tokens, 64 rows) and prefill chunks (4096 tokens; 16384, the H200's offline
chunk: ~1000 rows per expert). Small tiles are timed up to 1024 tokens, large ones from 1024.

Why: the GEMMs are most of a MoE layer's device time, and their tiles were chosen without a
GPU. (Compiled for sm_90 as a launch specializes, tools/bench_moe_sass.py, none of these tilings
spills; the 528 B of stack an earlier version of that tool reported came from a compile without
the launch's alignment specialization.) Each config's output is checked against the default's
(equal within bf16 rounding).
Device time per call from CUDA-graph replays (decode replays graphs; at prefill sizes the host
launches are hidden anyway). Ends with the fastest tiling per token count and its speedup over the
default: the line to change in `moe._tiling`. < 90 s on an H200.

Findings: docs/performance.md, "Profiles of the large shapes".

    python tools/bench_moe_tiles.py [--tokens 64,256,1024,4096,16384] [--experts 128] [--top-k 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from minisgl.kernels.moe import _Tiling, _tiling, dense_weights, run_experts
from minisgl.kernels.moe_routing import topk_route

# The GEMM sweeps' graph timing (calls back to back in one CUDA graph, median of its replays).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_gemm import graph_us

# (block_m, block_n, block_k, warps, stages). vLLM's tuned H200 table for this shape (E=128,
# N=768; its gate_up is one GEMM of 2N columns, so its BLOCK_N 256 is our 128) picks bm 16, bk 128
# up to 128 tokens, (32, 256, 128, 4 warps) at 256, and (128, 256, 64, 8 warps, 4 stages) from 1024.
SMALL = [  # up to 1024 tokens (<= 64 rows per expert)
    (16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 128, 4, 2), (16, 64, 64, 4, 5), (32, 64, 64, 4, 3),
    (32, 64, 64, 8, 3), (32, 128, 128, 4, 2),
]  # fmt: skip
LARGE = [  # from 1024 tokens
    (64, 64, 64, 4, 2), (64, 64, 64, 8, 3), (64, 128, 64, 8, 3), (64, 64, 32, 4, 3), (128, 64, 64, 8, 3),
    (128, 128, 64, 8, 4),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,256,1024,4096,16384")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU microbench"
    experts, top_k, hidden, inter = args.experts, args.top_k, args.hidden, args.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(torch.bfloat16)
    gate_up, down = dense_weights(w13), dense_weights(w2)
    began = time.perf_counter()
    verdicts = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = topk_route(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True, True)
        weights = weights.to(torch.bfloat16)
        default = _tiling(tokens * top_k, experts, torch.bfloat16)
        ref = run_experts(x, gate_up, down, weights, ids)
        touched = int(torch.unique(ids).numel())
        # Expert bytes read at least once, and the GEMM FLOPs, over ~4.2 TB/s and ~800 TFLOP/s dense bf16.
        floor_us = max(touched * 3 * hidden * inter * 2 / 4.2e6, tokens * top_k * 3 * hidden * inter * 2 / 8e8)
        print(f"tokens {tokens} (pairs {tokens * top_k}, {tokens * top_k / experts:.0f} rows per expert, experts touched "
              f"{touched}): floor ~{floor_us:.0f} us; default {tuple(default)}")  # fmt: skip
        configs = [c for c in (SMALL if tokens <= 1024 else []) + (LARGE if tokens >= 1024 else [])]
        if tuple(default) not in configs:
            configs.insert(0, tuple(default))
        repeats = 20 if tokens <= 1024 else 5
        results: dict[tuple[int, ...], float] = {}
        for config in configs:
            tiling = _Tiling(*config)
            try:
                out = run_experts(x, gate_up, down, weights, ids, tiling=tiling)
                torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
                us = graph_us([lambda tiling=tiling: run_experts(x, gate_up, down, weights, ids, tiling=tiling)] * repeats)
            except Exception as error:  # a config that does not compile (shared memory): report it, go on
                print(f"  {config}: failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            results[config] = us
            mark = " <- default" if tiling == default else ""
            print(f"  bm={config[0]:<3} bn={config[1]:<3} bk={config[2]:<3} warps={config[3]} stages={config[4]}: "
                  f"{us:8.1f} us ({floor_us / us:4.0%} of the floor){mark}")  # fmt: skip
        if results:
            best = min(results, key=results.__getitem__)
            base = results.get(tuple(default), float("nan"))
            verdicts.append(f"  {tokens:>6} tokens: fastest {best} {results[best]:.1f} us, "
                            f"{base / results[best]:.2f}x the default {tuple(default)}")  # fmt: skip
    print(f"fastest per token count ({time.perf_counter() - began:.0f} s):")
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
