"""Decode attention over float8 KV pages against bf16 pages on the GPU, per widening route and
launch (issue 25: the fp8 KV workload ran slower than bf16). `python tools/bench_fp8_decode.py`

Shapes: Qwen3-0.6B (16 q heads, 8 KV heads, head_dim 128), 16-token pages scattered over a large
pool, the offline workload's own decode batches at a few steps (`--steps`, the issue's command,
seed 0) and bs=1 at an 1100-token context with the bs=1 graph launch. For each batch: the bf16
cache at the default launch, then the float8 cache for each route of `decode.FP8_ROUTES` x
block_n x stages (`--routes`, `--block-n`, `--stages`, `--warps`, `--splits`), in us per call
(graph-replayed, 10 calls per replay) and TB/s of K/V bytes read at the cache's element size;
each float8 output is checked against the bf16 one over the same (quantized) pages. `--store`:
the KV store kernel at 1 and 256 tokens, bf16 and float8 pages. Whole run ~60-100 s.

The device call (one H200, ~7 min; the tool, the fp8kv phase's three engine runs, bs=1 bf16):
    TOOL="bench_fp8_decode.py --routes f16,f16-staged --block-n 32,64 --warps 2 --stages 3,4 --more-splits
    --steps 50,200,390,600,800,950" TOOL_LIMIT=200 BUDGET=540 bash scripts/gpu_run.sh tool,fp8kv; \
    PYTHONPATH=$PWD:/tmp/site timeout 45 python3 -m minisgl.bench offline --quiet --model configs/qwen3-0.6b \
      --dummy-weights --num-seqs 1 --min-input 128 --max-input 128 --min-output 1024 --max-output 1024

Research tool, not product code (the routes are `decode_attention(fp8_route=...)`).

Findings: docs/performance.md, "Float8 KV decode" (and BENCHMARKS.md, fourteenth session).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep_decode_attention import (
    HKV,
    HQ,
    D,
    bench,
    longest_first,
    make_batch,
    workload_lens,
)

from minisgl.kernels.attention import (
    decode_attention,
    decode_graph_launch,
    decode_num_splits,
)
from minisgl.kernels.attention.decode import FP8_ROUTES

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.02, 0.01


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routes", default="q,f16,f16-staged", help=f"float8 widening routes, of {FP8_ROUTES}")
    p.add_argument("--block-n", default="64,128", help="keys per tile for the float8 launches")
    p.add_argument("--stages", default="2,3")
    # 128 keys on 2 warps spill (255 registers, sm_90 ptxas): 4 warps hold them
    p.add_argument("--warps", default="2,4")
    p.add_argument("--splits", default="", help="split counts (default: the engine's for the batch)")
    p.add_argument("--more-splits", action="store_true", help="also twice the engine's split count")
    p.add_argument("--steps", default="50,390,800", help="workload steps whose decode batch is timed")
    p.add_argument("--no-bs1", action="store_true", help="skip the bs=1 case")
    p.add_argument("--store", action="store_true", help="also time the KV store kernel")
    p.add_argument("--num-pages", type=int, default=40000, help="16-token pages in the pool")
    p.add_argument("--bs1-len", type=int, default=1100, help="context of the bs=1 case")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of this tool under the Triton interpreter (one call each, no timing)")
    return p.parse_args()


def run_case(label: str, lens: list[int], caches: dict, args: argparse.Namespace, launches: list[dict]) -> None:
    dev = caches["bf16"][0].device
    table, rows, seq_lens, q, out, _ = make_batch(lens, args.num_pages, dev)
    order = longest_first(lens, dev)
    tokens = sum(lens)
    k16, v16 = caches["bf16"]
    q, out = q.to(k16.dtype), out.to(k16.dtype)
    k8, v8 = caches["fp8"]
    ref = None
    print(f"-- {label}: bs {len(lens)}, {tokens} tokens")
    print(f"{'cache':>5} {'route':>11} {'splits':>6} {'blk':>4} {'w':>2} {'st':>2} {'us':>8} {'TB/s':>6} {'vs bf16':>7} {'max err':>8}")
    bf16_us = None
    for launch in launches:
        for cache, route in [("bf16", None)] + [("fp8", r) for r in args.route_list]:
            if cache == "bf16" and not launch.get("bf16", False):
                continue
            k, v = (k16, v16) if cache == "bf16" else (k8, v8)
            kw = {key: val for key, val in launch.items() if key != "bf16"}
            scales = {} if cache == "bf16" else {"k_scale": K_SCALE, "v_scale": V_SCALE, "fp8_route": route}
            fn = lambda: decode_attention(q, k, v, table, rows, seq_lens, D**-0.5, out=out, order=order,
                                          **kw, **scales)  # fmt: skip
            try:
                us = bench(fn) if not args.smoke else 1.0
            except Exception as e:  # a launch that does not compile (shared memory) is reported, not fatal
                print(f"{cache:>5} {route or '-':>11} {kw['num_splits']:>6} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            got = fn().float()
            if cache == "bf16":
                if ref is None:
                    # the reference for the float8 runs: bf16 attention over the dequantized pages
                    kd, vd = (k8.float() * K_SCALE).to(k16.dtype), (v8.float() * V_SCALE).to(k16.dtype)
                    ref = decode_attention(q, kd, vd, table, rows, seq_lens, D**-0.5, order=order,
                                           num_splits=kw["num_splits"]).float()  # fmt: skip
                    del kd, vd
                bf16_us = us if bf16_us is None else min(bf16_us, us)
                err = "-"
            else:
                err = f"{(got - ref).abs().max().item():.1e}" if ref is not None else "-"
            nbytes = 2 * tokens * HKV * D * k.element_size()
            ratio = f"{bf16_us / us:.2f}x" if bf16_us else "-"
            print(f"{cache:>5} {route or '-':>11} {kw['num_splits']:>6} {kw.get('block_n') or '-':>4} "
                  f"{kw.get('num_warps') or '-':>2} {kw.get('num_stages') or '-':>2} {us:>8.1f} "
                  f"{nbytes / us / 1e6:>6.2f} {ratio:>7} {err:>8}", flush=True)  # fmt: skip


def store(caches: dict, smoke: bool) -> None:
    from minisgl.kernels.store_kv import store_kv

    print("-- KV store kernel (one layer), us per call")
    dev = caches["bf16"][0].device
    for tokens in (1, 256):
        kv = torch.randn(tokens, 2, HKV, D, device=dev).to(caches["bf16"][0].dtype)
        loc = torch.randperm(caches["bf16"][0].shape[0], device=dev)[:tokens]
        for cache in ("bf16", "fp8"):
            k, v = caches[cache]
            fn = lambda: store_kv(kv[:, 0], kv[:, 1], k, v, loc, K_SCALE, V_SCALE)
            us = bench(fn) if not smoke else (fn(), 1.0)[1]
            print(f"tokens {tokens:>4} {cache:>5} {us:>7.2f}")


def main() -> None:
    args = parse()
    args.route_list = [r for r in args.routes.split(",") if r]
    assert all(r in FP8_ROUTES for r in args.route_list), f"--routes: of {FP8_ROUTES}"
    start = time.time()
    dev = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(0)
    slots = args.num_pages * 16
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dots are not exact
    k16 = (torch.randn(slots, HKV, D, device=dev) * 0.5).to(dtype)
    v16 = (torch.randn(slots, HKV, D, device=dev) * 0.5).to(dtype)
    k8 = (k16.float() / K_SCALE).clamp(-448, 448).to(FP8)
    v8 = (v16.float() / V_SCALE).clamp(-448, 448).to(FP8)
    caches = {"bf16": (k16, v16), "fp8": (k8, v8)}
    print(torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)", "torch", torch.__version__, flush=True)
    for step, lens in workload_lens(tuple(ints(args.steps))):
        splits = ints(args.splits) or [decode_num_splits(len(lens), HKV, D, None, dev)]
        if args.more_splits:
            splits = sorted({*splits, *(2 * s for s in splits)})
        graph = decode_graph_launch(len(lens), HQ, HKV, D, torch.bfloat16, dev)._asdict()
        graph8 = decode_graph_launch(len(lens), HQ, HKV, D, FP8, dev)._asdict()
        # the launches the engine captures for this size: bf16 pages', then float8 pages'
        launches = [dict(graph, bf16=True), dict(graph8, bf16=False)]
        for s, bn, w, st in itertools.product(splits, ints(args.block_n), ints(args.warps), ints(args.stages)):
            launches.append(dict(num_splits=s, block_n=bn, num_warps=w, num_stages=st, bf16=bn == 64 and st == 2))
        run_case(f"workload step {step}", lens, caches, args, launches)
    if not args.no_bs1:
        graph = decode_graph_launch(1, HQ, HKV, D, torch.bfloat16, dev)._asdict()
        graph8 = decode_graph_launch(1, HQ, HKV, D, FP8, dev)._asdict()
        launches = [dict(graph, bf16=True), dict(graph8, bf16=False)] + [
            dict(graph, block_n=bn, num_stages=st) for bn, st in itertools.product((32, 64), (3, 4))
        ]
        run_case(f"bs=1, {args.bs1_len} tokens (the bs=1 graph launch)", [args.bs1_len], caches, args, launches)
    if args.store:
        store(caches, args.smoke)
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
