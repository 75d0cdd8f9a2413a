"""The fused expert GEMMs' tiles at Qwen3-30B-A3B's expert shape (issue 28): `moe.run_experts`
(align + gate_up + down + the top-k sum) timed per tiling (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages) at prefill and decode token counts, beside the default `moe._tiling` picks, and the
dense-GEMM bound of the same bytes and FLOPs for scale.

Why: compiled for sm_90 without a GPU, the default prefill tile (BLOCK_M 64, 4 warps) spills
~528 B a thread of stack in the gate_up kernel (cuobjdump -res-usage: 255 registers), and
BLOCK_M 32 spills ~280 B; 8 warps at BLOCK_M 64 spill nothing (227 registers). Only a GPU can say
which is faster. Each config's output is checked against the default's (equal within bf16
rounding). < 90 s on an H200.

Findings: docs/performance.md, "Profiles of the large shapes".

    python tools/bench_moe_tiles.py [--tokens 64,1024,4096,8192] [--experts 128] [--top-k 8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from minisgl.kernels.moe import _Tiling, _tiling, dense_weights, run_experts
from minisgl.kernels.moe_routing import topk_route

CONFIGS = [  # (block_m, block_n, block_k, warps, stages)
    (16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (32, 64, 64, 8, 3), (64, 64, 64, 4, 2), (64, 64, 64, 8, 2),
    (64, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 64, 32, 4, 3),
]  # fmt: skip


def time_us(call: object, repeats: int = 20) -> float:
    """Device us per call: CUDA events around `repeats` calls, median of 5."""
    call()  # type: ignore[operator]
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()  # type: ignore[operator]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,1024,4096,8192")
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
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = topk_route(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True, True)
        weights = weights.to(torch.bfloat16)
        default = _tiling(tokens * top_k, experts, torch.bfloat16)
        ref = run_experts(x, gate_up, down, weights, ids)
        touched = int(torch.unique(ids).numel())
        # Expert bytes read at least once, and the GEMM FLOPs, over ~4.2 TB/s and ~800 TFLOP/s dense bf16.
        floor_us = max(touched * 3 * hidden * inter * 2 / 4.2e6, tokens * top_k * 3 * hidden * inter * 2 / 8e8)
        print(f"tokens {tokens} (pairs {tokens * top_k}, experts touched {touched}): floor ~{floor_us:.0f} us; "
              f"default {tuple(default)}")  # fmt: skip
        for config in CONFIGS:
            tiling = _Tiling(*config)
            try:
                out = run_experts(x, gate_up, down, weights, ids, tiling=tiling)
                torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
                us = time_us(lambda tiling=tiling: run_experts(x, gate_up, down, weights, ids, tiling=tiling))
            except Exception as error:  # a config that does not compile (shared memory): report it, go on
                print(f"  {config}: failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            mark = " <- default" if tiling == default else ""
            print(f"  bm={config[0]:<3} bn={config[1]:<3} bk={config[2]:<3} warps={config[3]} stages={config[4]}: "
                  f"{us:8.1f} us{mark}")  # fmt: skip


if __name__ == "__main__":
    main()
