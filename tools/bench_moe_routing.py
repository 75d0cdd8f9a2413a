"""MoE routing + grouping, torch ops (old) vs the fused Triton kernels (new), at the issue-10
workload's token counts on Qwen3-30B-A3B's router shape (128 experts, top 8, bf16; issue 28).

Old: `moe_ref.route_ref` (softmax, topk, renormalise, cast) + `moe_ref.align_by_expert_ref`
(histogram, scans, stable sort, scatter, searchsorted): what layers/moe.py ran before. New:
`moe_routing.topk_route` + `moe_routing.align_tiles`: two launches. Per token count it prints
- eager us per call, launches back to back from the host (what a prefill step pays: the
  launch-queue cost that the profile showed), and
- graph us per call (device time only; decode steps replay graphs),
and the whole SparseMoeBlock forward (router GEMM + routing + align + experts + sum) eager, new
path, for scale. < 60 s on an H200.

It also checks, per token count, the new tiles against the old on the new ids, and the new ids
(`check_ids`) on two inputs: fp32 Gaussian logits, and the bench's own bf16 logits widened to
fp32 (bf16 has 8 significant bits: ~29 % of rows at 128 experts hold two equal logits among
their top 9). The kernel's rule is exact on any device (`moe_ref.topk_ids_ref`: the top k logits,
ties to the lower id); the torch reference's topk agrees with it wherever its probabilities do not
tie, and orders ties its own way on CUDA. A row that breaks the rule, or differs from the
reference without a tie, is a kernel bug: the first ones are printed (token, both id lists, the
logits and probabilities there) and the run exits non-zero at the end. On an H200 (1..8192
tokens): no row broke the rule; 0 rows differed on fp32 Gaussian logits; on the bf16-valued ones
~28 % of rows tied and ~17 % differed, each of them tied, CUDA's topk putting the higher id of a
tie first (the first version of this check asserted plain equality there and failed at 16 tokens).

Findings: docs/performance.md, "Profiles of the large shapes".

    python tools/bench_moe_routing.py [--tokens 1,64,256,1024,4096,8192] [--experts 128] [--top-k 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from minisgl.kernels.moe import _tiling
from minisgl.kernels.moe_ref import (
    align_by_expert_ref,
    route_ref,
    route_scores_ref,
    tied_rows_ref,
    topk_ids_ref,
)
from minisgl.kernels.moe_routing import align_tiles, num_tiles_bound, topk_route
from minisgl.layers.moe import SparseMoeBlock

# The GEMM sweeps' graph timing (calls back to back in one CUDA graph, median of its replays).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_gemm import graph_us

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


def check_ids(logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool, name: str) -> bool:
    """The kernel's ids on `logits` against its rule and against `route_ref`; prints a summary
    line, and the first rows that break the rule or differ from the reference where it has no
    tie. True when no row is a bug."""
    _, ids = topk_route(logits, top_k, softmax_first, renormalize)
    _, ref_ids = route_ref(logits, top_k, softmax_first, renormalize)
    rule = topk_ids_ref(logits, top_k)
    scores = route_scores_ref(logits, softmax_first).float()
    tied = tied_rows_ref(scores, top_k)  # the reference may order (or pick) these its own way
    differ = (ids != ref_ids).any(dim=-1)
    broken = (ids != rule).any(dim=-1) | (differ & ~tied)
    print(f"  ids on {name}: {logits.shape[0]} rows, {int(tied.sum())} with tied scores, "
          f"{int(differ.sum())} differ from route_ref (all tied: {bool((~differ | tied).all())}), "
          f"{int(broken.sum())} break the rule")  # fmt: skip
    shown = torch.nonzero(broken).flatten().tolist()[:3] + torch.nonzero(differ & ~broken).flatten().tolist()[:1]
    for row in shown:
        kind = "BUG" if broken[row] else "tie"
        both = torch.cat([ids[row], ref_ids[row]]).unique()
        print(f"    {kind} token {row}: kernel {ids[row].tolist()} ref {ref_ids[row].tolist()} rule {rule[row].tolist()}")
        print(f"      at ids {both.tolist()}: logits {logits[row, both].float().tolist()}")
        print(f"      scores {scores[row, both].tolist()}")
    return not bool(broken.any())


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
    failed = False
    torch.manual_seed(0)
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

        # Tiles on the new ids (ties in bf16 logits are broken differently by the old routing).
        _, ids = topk_route(logits, top_k, True, True)
        tiles = align_tiles(ids, experts, block_m)
        ref_pairs, ref_experts = align_by_expert_ref(ids, experts, block_m, num_tiles)
        if not (torch.equal(tiles.sorted_pairs, ref_pairs) and torch.equal(tiles.tile_expert, ref_experts)):
            print(f"  tiles at {tokens} tokens differ from align_by_expert_ref: BUG")
            failed = True
        gaussian = torch.randn(tokens, experts, device="cuda")
        for name, inputs in (("fp32 Gaussian logits", gaussian), ("the bf16 logits in fp32", logits.float())):
            failed |= not check_ids(inputs, top_k, True, True, name)
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer = eager_us(lambda x=x: block(x))
        print(f"{tokens:>6} {eager_us(old):>10.1f} {eager_us(new):>10.1f} {graph_us([old] * REPEATS):>10.1f} {graph_us([new] * REPEATS):>10.1f} "
              f"{layer:>12.1f}")  # fmt: skip
    if failed:
        sys.exit("routing or tiles broke their rule: see the BUG rows above")


if __name__ == "__main__":
    main()
