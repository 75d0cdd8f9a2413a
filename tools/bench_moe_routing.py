"""MoE routing + grouping, torch ops (old) vs the fused Triton kernels (new), at the issue-10
workload's token counts on Qwen3-30B-A3B's router shape (128 experts, top 8, bf16; issue 28).

Old: `moe_ref.route_ref` (softmax, topk, renormalise, cast) + `moe_ref.align_by_expert_ref`
(histogram, scans, stable sort, scatter, searchsorted): what layers/moe.py ran before. New:
`moe_routing.topk_route` + `moe_routing.align_tiles`: two launches. Per token count it prints
- eager us per call, launches back to back from the host (what a prefill step pays: the
  launch-queue cost that the profile showed), and
- graph us per call (device time only; decode steps replay graphs),
and the whole SparseMoeBlock forward (router GEMM + routing + align + experts + sum) eager, new
path, for scale. Also checks the new ids and tiles equal the old on each input. < 60 s on an H200.

Findings: docs/performance.md, "Profiles of the large shapes".

    python tools/bench_moe_routing.py [--tokens 1,64,256,1024,4096,8192] [--experts 128] [--top-k 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from minisgl.kernels.moe import _tiling
from minisgl.kernels.moe_ref import align_by_expert_ref, route_ref
from minisgl.kernels.moe_routing import align_tiles, num_tiles_bound, topk_route
from minisgl.layers.moe import SparseMoeBlock

REPEATS = 50


def eager_us(call: Callable[[], object]) -> float:
    """us per call, REPEATS calls launched back to back, median of 5 rounds."""
    call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(REPEATS):
            call()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) * 1e6 / REPEATS)
    return statistics.median(rounds)


def graph_us(call: Callable[[], object]) -> float:
    """Device us per call: REPEATS calls in one CUDA graph, median of 10 replays."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            call()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEATS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,64,256,1024,4096,8192")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU microbench"
    experts, top_k = args.experts, args.top_k
    with torch.device("cuda"):
        block = SparseMoeBlock(experts, top_k, args.hidden, args.inter, norm_topk_prob=True, impl="triton")
    for param in block.parameters():
        param.data = (torch.randn_like(param) * 0.02).to(torch.bfloat16)
    print(f"{experts} experts, top {top_k}, bf16; us per call (eager: host-launched back to back; graph: device)")
    print(f"{'tokens':>6} {'old eager':>10} {'new eager':>10} {'old graph':>10} {'new graph':>10} {'layer eager':>12}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        logits = torch.randn(tokens, experts, device="cuda").to(torch.bfloat16)
        block_m = _tiling(tokens * top_k, experts, torch.bfloat16).block_m
        num_tiles = num_tiles_bound(tokens * top_k, experts, block_m)

        def old(logits: torch.Tensor = logits, block_m: int = block_m, num_tiles: int = num_tiles) -> object:
            weights, ids = route_ref(logits, top_k, True, True)
            return weights, align_by_expert_ref(ids, experts, block_m, num_tiles)

        def new(logits: torch.Tensor = logits, block_m: int = block_m) -> object:
            weights, ids = topk_route(logits, top_k, True, True)
            return weights, align_tiles(ids, experts, block_m)

        # The same routing in both (ties in bf16 logits may be broken differently): compare tiles
        # on the new ids, and the ids on fp32 logits.
        _, ids = topk_route(logits, top_k, True, True)
        tiles = align_tiles(ids, experts, block_m)
        ref_pairs, ref_experts = align_by_expert_ref(ids, experts, block_m, num_tiles)
        assert torch.equal(tiles.sorted_pairs, ref_pairs) and torch.equal(tiles.tile_expert, ref_experts)
        assert torch.equal(topk_route(logits.float(), top_k, True, True)[1], route_ref(logits.float(), top_k, True, True)[1])
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer = eager_us(lambda x=x: block(x))
        print(f"{tokens:>6} {eager_us(old):>10.1f} {eager_us(new):>10.1f} {graph_us(old):>10.1f} {graph_us(new):>10.1f} "
              f"{layer:>12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
