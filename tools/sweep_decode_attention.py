"""Launch-parameter sweep of the split-K decode attention on the GPU, on the shapes the offline
benchmark spends its time in (Qwen3-0.6B: 8 KV heads, 16 q heads, head_dim 128, bf16, 16-token
pages scattered over a large pool). `python tools/sweep_decode_attention.py`

For each (batch, context) it prints the default launch and the best few of the swept ones, in us
per call and in TB/s of K/V read (graph-replayed, so launch overhead is what a CUDA graph sees).
`--ragged`: batches of lengths uniform in [100, 2048] (as the offline workload's decode has), one
split or more, programs in batch order or longest first. `--workload`: the offline workload's own
decode batches at a few steps, default launch against a sweep. `--layout`: the same batches with the
pool token-major ([slots, Hkv, D], the engine's) against head-major ([Hkv, slots, D] seen through a
permuted view: each head's page is one contiguous 4 KB run). `--extend`: the extend kernel on
16k-token chunks of fresh prompts of the workload's lengths and on long-prefix chunks, at a few
launch shapes (packed q heads or not). `--pages`: the default launch on the workload's batches
with pages of 16-256 tokens, and with each request's KV contiguous. `--graphs`: per captured
batch size, the workload's batch padded as a replay pads it, the engine's launch against a sweep.
`--readbw`: what this GPU reads at best (a streaming read of a 4 GB buffer, torch's sum and a
Triton kernel). `--gatherbw`: on the workload's decode batches, pure reads of their K/V through the
token table as the attention's programs (one per request and KV head) and as one program per
request and split reading whole token rows (all KV heads: 2 KB runs).

Research tool, not product code. Findings: docs/performance.md, sections "Triton paged attention"
and "Launches measured per captured batch size"; the --readbw / --gatherbw reads in the paragraph
after "Where the H200 workload's ~4.8-4.9 s go".
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

from minisgl.attention.triton_backend import _longest_first
from minisgl.kernels.attention import GRAPH_TUNED, decode_attention, decode_num_splits, extend_attention
from minisgl.kernels.tuning import device_name

HQ, HKV, D, PAGE = 16, 8, 128, 16
SHAPES = [(256, 512), (256, 900), (128, 1000), (64, 1200), (32, 1000), (8, 1000), (1, 1100)]


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=40) / 10 * 1e3  # us per call


def make_batch(lens: list[int], num_pages: int, dev: torch.device, page: int = PAGE,
               scatter: bool = True) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(token table, rows, seq_lens, q, out, K/V bytes read) for requests of these lengths, their
    `page`-token pages scattered over the pool (`num_pages` 16-token pages), or with
    `scatter=False` each request's pages one contiguous run."""
    bs, ctx = len(lens), max(lens)
    pages_per_req = triton.cdiv(ctx, page)
    total = num_pages * PAGE // page
    perm = torch.randperm(total, device=dev) if scatter else torch.arange(total, device=dev)
    perm = perm[: bs * pages_per_req].view(bs, pages_per_req)
    table = (perm[:, :, None] * page + torch.arange(page, device=dev)).view(bs, -1)[:, :ctx].to(torch.int32).contiguous()
    rows = torch.arange(bs, device=dev, dtype=torch.int32)
    seq_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    q = torch.randn(bs, HQ, D, device=dev, dtype=torch.bfloat16)
    return table, rows, seq_lens, q, torch.empty_like(q), 2 * sum(lens) * HKV * D * 2


def longest_first(lens: list[int], dev: torch.device) -> torch.Tensor:
    """The decode kernel's `order` as the engine passes it: the requests longest first."""
    return torch.tensor(_longest_first(lens), device=dev, dtype=torch.int32)


def workload_lens(steps: tuple[int, ...]):
    """(step, context lengths of the requests still decoding at that step) of the offline workload
    (the issue's command, seed 0)."""
    from minisgl.bench.offline import build_parser, make_workload

    args = build_parser().parse_args("--model configs/qwen3-0.6b --num-seqs 256 --min-input 100 --max-input 1024 "
                                     "--min-output 100 --max-output 1024 --seed 0".split())  # fmt: skip
    prompts, outputs = make_workload(args)
    for step in steps:
        yield step, [len(p) + step + 1 for p, n in zip(prompts, outputs) if n > step]


def pages(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    """The default decode launch on the workload's batches with pages of 16..256 tokens scattered
    over the pool, and with each request's KV one contiguous run."""
    print(f"{'step':>4} {'bs':>4} {'page':>8} {'us':>8} {'TB/s':>6}")
    for step, lens in workload_lens((50, 200, 390, 600, 800, 950)):
        bs = len(lens)
        order = longest_first(lens, k.device)
        splits = decode_num_splits(bs, HKV, D, None, k.device)
        for page, scatter in ((16, True), (32, True), (64, True), (128, True), (256, True), (16, False)):
            table, rows, seq_lens, q, out, nbytes = make_batch(lens, num_pages, k.device, page, scatter)
            us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits, out=out,
                                                order=order))  # fmt: skip
            name = str(page) if scatter else "contig"
            print(f"{step:>4} {bs:>4} {name:>8} {us:>8.1f} {nbytes / us / 1e6:>6.2f}", flush=True)


def ragged(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    print(f"{'bs':>4} {'tokens':>7} {'splits':>6} {'order':>8} {'us':>8} {'TB/s':>6}")
    for bs in (256, 192, 128, 64, 32):
        lens = torch.randint(100, 2049, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
        table, rows, seq_lens, q, out, nbytes = make_batch(lens, num_pages, k.device)
        longest = longest_first(lens, k.device)
        for splits, (name, order) in itertools.product((1, 2, 4), (("batch", None), ("longest", longest))):
            us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits, out=out,
                                                order=order))  # fmt: skip
            print(f"{bs:>4} {sum(lens):>7} {splits:>6} {name:>8} {us:>8.1f} {nbytes / us / 1e6:>6.2f}")


def graphs(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    """Per captured decode batch size, as a replay runs it: the workload's batch at the last step
    that still fills it (GRAPH_AT=mid: the middle of the steps the size serves), padded with empty
    rows to the captured size, split as the engine splits a captured batch; the heuristic launch
    and the tuned one (GRAPH_TUNED) against a sweep of splits, warps, stages and blocks.
    GRAPH_SIZES=a,b,...: only those sizes."""
    from minisgl.engine.graph import graph_batch_sizes

    steps = list(workload_lens(tuple(range(0, 1024, 4))))
    at_mid = os.environ.get("GRAPH_AT", "last") == "mid"
    only = {int(x) for x in os.environ.get("GRAPH_SIZES", "").split(",") if x}
    sizes = graph_batch_sizes(256)
    print(f"{'graph bs':>8} {'live':>4} {'step':>4} {'default us':>10} {'tuned us':>8} {'best us':>8} {'best launch':>28}")
    for prev, size in zip([0] + sizes, sizes):
        serves = [(step, lens) for step, lens in steps if prev < len(lens) <= size]
        if not serves or (only and size not in only):
            continue
        step, lens = serves[len(serves) // 2] if at_mid else serves[0]
        padded = lens + [0] * (size - len(lens))
        table, rows, seq_lens, q, out, _ = make_batch([max(n, 1) for n in padded], num_pages, k.device)
        seq_lens.copy_(torch.tensor(padded, device=k.device, dtype=torch.int32))
        nbytes = 2 * sum(lens) * HKV * D * 2
        order = longest_first(padded, k.device)
        splits0 = decode_num_splits(size, HKV, D, None, k.device)
        tuned = GRAPH_TUNED.get((device_name(k.device), HKV, HQ, D), {}).get(size)
        results = []
        for splits, blk, warps, stages in itertools.product(
            sorted({max(1, splits0 // 2), splits0, min(64, splits0 * 2)}), (32, 64), (2, 4), (2, 3, 4)
        ):
            us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits, out=out,
                                                order=order, block_n=blk, num_warps=warps, num_stages=stages))  # fmt: skip
            results.append((us, splits, blk, warps, stages))
        default = next(r for r in results if r[1:] == (splits0, 64, 2, 2 if splits0 == 1 else 3))
        tuned_us = "-"
        if tuned is not None:
            us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, out=out, order=order,
                                                **tuned._asdict()))  # fmt: skip
            tuned_us = f"{us:.1f}"
        for rank, best in enumerate(sorted(results)[:3]):  # the best three, to tell a win from noise
            launch = f"{best[1]} splits, blk {best[2]}, w {best[3]}, st {best[4]}"
            first = f"{size:>8} {len(lens):>4} {step:>4} {default[0]:>10.1f} {tuned_us:>8}" if rank == 0 else " " * 38
            print(f"{first} {best[0]:>8.1f} {launch:>28} ({nbytes / best[0] / 1e6:.2f} TB/s)", flush=True)


def workload(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    """The offline workload's own decode batches (the issue's command, seed 0) at a few steps: the
    default launch against the swept ones, programs longest first."""
    print(f"{'step':>4} {'bs':>4} {'tokens':>7} {'splits':>6} {'blk':>4} {'w':>2} {'st':>2} {'us':>8} {'TB/s':>6}")
    steps = tuple(int(x) for x in os.environ.get("SWEEP_STEPS", "50,200,390,600,800,950").split(","))
    for step, lens in workload_lens(steps):
        bs = len(lens)
        table, rows, seq_lens, q, out, nbytes = make_batch(lens, num_pages, k.device)
        order = longest_first(lens, k.device)
        default_splits = decode_num_splits(bs, HKV, D, None, k.device)
        results = []
        split_options = {default_splits, max(1, default_splits // 2), default_splits * 2, min(64, default_splits * 4)}
        for splits, blk, warps, stages in itertools.product(sorted(split_options), (32, 64), (2, 4), (2, 3, 4)):
            us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits, out=out,
                                                order=order, block_n=blk, num_warps=warps, num_stages=stages))  # fmt: skip
            results.append((us, splits, blk, warps, stages))
        default = next(r for r in results if r[1:] == (default_splits, 64, 2, 2 if default_splits == 1 else 3))
        for tag, (us, splits, blk, warps, stages) in [("default", default)] + [("", r) for r in sorted(results)[:3]]:
            print(f"{step:>4} {bs:>4} {sum(lens):>7} {splits:>6} {blk:>4} {warps:>2} {stages:>2} {us:>8.1f} "
                  f"{nbytes / us / 1e6:>6.2f} {tag}")  # fmt: skip


# The extend kernel's launches tried on the workload's chunks (block_m, block_n, warps, stages); the
# first is the tuned default.
# pack: a KV head's q heads share the tile (rows = queries x group).
EXTEND_LAUNCHES = [(64, 64, 4, 3, False), (128, 64, 8, 3, False), (128, 64, 4, 3, False), (64, 32, 4, 3, False),
                   (128, 32, 8, 3, False), (64, 64, 8, 3, False),
                   (64, 64, 4, 3, True), (64, 32, 4, 3, True), (128, 64, 8, 3, True), (128, 64, 4, 3, True),
                   (128, 32, 8, 3, True), (128, 32, 4, 3, True), (128, 128, 8, 2, True), (256, 64, 8, 2, True)]


def time_extend_launches(label: str, q, k, v, table, rows, seq_lens, extend_lens, starts, flops: float) -> None:
    """Each of EXTEND_LAUNCHES on one batch: checked against the first (the default), then timed."""
    ref = None
    max_extend_len = int(extend_lens.max())
    for bm, bn, warps, stages, pack in EXTEND_LAUNCHES:
        try:
            run = lambda: extend_attention(q, k, v, table, rows, seq_lens, extend_lens, starts, 0.088,  # noqa: E731
                                           max_extend_len=max_extend_len, block_m=bm, block_n=bn,
                                           num_warps=warps, num_stages=stages, pack=pack)  # fmt: skip
            got = run().float()
            ref = got if (bm, bn, warps, stages, pack) == EXTEND_LAUNCHES[0] else ref
            assert ref is not None and (got - ref).abs().max().item() < 2e-2, "differs from the default launch"
            us = bench(run)
        except Exception as exc:  # out of shared memory, or a wrong result
            print(f"  skip {bm}x{bn} w{warps} s{stages}: {type(exc).__name__}")
            continue
        launch = f"{bm}x{bn} w{warps} s{stages}{' pk' if pack else ''}"
        print(f"{label:>7} {len(extend_lens):>4} {q.shape[0]:>7} {launch:>18} {us:>8.1f} {flops / us / 1e6:>8.1f}")


def extend(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    """One prefill chunk as the offline workload's first steps have: fresh prompts, lengths
    uniform in [100, 1024], up to 16k tokens; the extend kernel at EXTEND_LAUNCHES."""
    dev = k.device
    gen = torch.Generator().manual_seed(0)
    print(f"{'chunk':>7} {'reqs':>4} {'tokens':>7} {'launch':>18} {'us':>8} {'TFLOP/s':>8}")
    for chunk in range(3):
        lens: list[int] = []
        while sum(lens) < 16384 - 1024:
            lens.append(int(torch.randint(100, 1025, (1,), generator=gen)))
        table, rows, seq_lens, _, _, _ = make_batch(lens, num_pages, dev)
        extend_lens = seq_lens.clone()
        starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], device=dev, dtype=torch.int32)
        q = torch.randn(sum(lens), HQ, D, device=dev, dtype=torch.bfloat16)
        flops = sum(4 * n * (n + 1) / 2 * D * HQ for n in lens)
        time_extend_launches(str(chunk), q, k, v, table, rows, seq_lens, extend_lens, starts, flops)
    # Long prompts cut in chunks: 1k-token chunks of 4 requests on 3k-token cached prefixes (the shape the
    # default launch was tuned on), and one 8k prompt's last 2k.
    for name, lens, new_tokens in (("4x1k/3k", [4096] * 4, 1024), ("2k/6k", [8192], 2048)):
        table, rows, seq_lens, _, _, _ = make_batch(lens, num_pages, dev)
        extend_lens = torch.full_like(seq_lens, new_tokens)
        starts = torch.arange(len(lens), device=dev, dtype=torch.int32) * new_tokens
        q = torch.randn(len(lens) * new_tokens, HQ, D, device=dev, dtype=torch.bfloat16)
        flops = sum(4 * new_tokens * (n - new_tokens / 2) * D * HQ for n in lens)
        time_extend_launches(name, q, k, v, table, rows, seq_lens, extend_lens, starts, flops)


def layout(num_pages: int, dev: torch.device) -> None:
    """Token-major vs head-major pool on the workload's decode batches, a few launches each."""

    def pool(head_major: bool) -> torch.Tensor:
        if head_major:
            return torch.randn(HKV, num_pages * PAGE, D, device=dev, dtype=torch.bfloat16).permute(1, 0, 2)
        return torch.randn(num_pages * PAGE, HKV, D, device=dev, dtype=torch.bfloat16)

    caches = {"token-major": (pool(False), pool(False)), "head-major": (pool(True), pool(True))}
    print(f"{'step':>4} {'bs':>4} {'layout':>12} {'splits':>6} {'blk':>4} {'st':>2} {'us':>8} {'TB/s':>6}")
    for step, lens in workload_lens((50, 200, 390, 600, 800, 950)):
        bs = len(lens)
        table, rows, seq_lens, q, out, nbytes = make_batch(lens, num_pages, dev)
        order = longest_first(lens, dev)
        splits0 = decode_num_splits(bs, HKV, D, None, dev)
        for name, (k, v) in caches.items():
            launches = ((splits0, 64, None), (splits0, 32, None), (splits0, 64, 4), (splits0 * 2, 64, None))
            for splits, blk, stages in launches:
                us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits, out=out,
                                                    order=order, block_n=blk, num_stages=stages))  # fmt: skip
                print(f"{step:>4} {bs:>4} {name:>12} {splits:>6} {blk:>4} {stages or '-':>2} {us:>8.1f} "
                      f"{nbytes / us / 1e6:>6.2f}")  # fmt: skip


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums ITERS consecutive blocks (grid-strided over programs) of x: a pure read."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (i * tl.num_programs(0) + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _gather_head_kernel(k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, order_ptr, stride_table,
                        HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Read one (request, KV head)'s K and V through the token table, as the decode attention does."""
    head = tl.program_id(0)
    req = tl.load(order_ptr + tl.program_id(1))
    seq_len = tl.load(seq_lens_ptr + req)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        mask = start + offs_n < seq_len
        slots = tl.load(table_ptr + req.to(tl.int64) * stride_table + start + offs_n, mask=mask, other=0).to(tl.int64)
        offs = (slots * HKV + head)[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + offs, mask=mask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=mask[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(out_ptr + (req * HKV + head) * D + offs_d, acc)


@triton.jit
def _gather_row_kernel(k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, order_ptr, stride_table,
                       HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Read one request's split of K and V, whole token rows (all KV heads) at a time."""
    split = tl.program_id(0)
    req = tl.load(order_ptr + tl.program_id(1))
    seq_len = tl.load(seq_lens_ptr + req)
    split_len = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    begin = split * split_len
    end = tl.minimum(begin + split_len, seq_len)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, HKV * D)
    acc = tl.zeros([HKV * D], dtype=tl.float32)
    for start in range(begin, end, BLOCK_N):
        mask = start + offs_n < end
        slots = tl.load(table_ptr + req.to(tl.int64) * stride_table + start + offs_n, mask=mask, other=0).to(tl.int64)
        offs = slots[:, None] * (HKV * D) + offs_c[None, :]
        k = tl.load(k_ptr + offs, mask=mask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=mask[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(out_ptr + (req * SPLITS + split) * (HKV * D) + offs_c, acc)


def gatherbw(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    dev = k.device
    for step, lens in workload_lens((50, 390, 800)):
        bs = len(lens)
        table, rows, seq_lens, q, out, nbytes = make_batch(lens, num_pages, dev)
        order = longest_first(lens, dev)
        splits0 = decode_num_splits(bs, HKV, D, None, dev)
        us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits0, out=out, order=order))
        print(f"step {step} bs {bs}: attention {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
        res = torch.empty(bs * HKV * D * 64, device=dev, dtype=torch.float32)
        for blk, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
            try:
                us = bench(lambda: _gather_head_kernel[(HKV, bs)](k, v, res, table, seq_lens, order, table.stride(0),
                           HKV=HKV, D=D, BLOCK_N=blk, num_warps=warps, num_stages=stages))  # fmt: skip
                print(f"   per head  blk {blk:>3} w {warps} st {stages}: {us:7.1f} us {nbytes / us / 1e6:.2f} TB/s")
            except Exception as exc:
                print(f"   per head  blk {blk} w {warps} st {stages}: {type(exc).__name__}")
        for blk, warps, stages, splits in itertools.product((8, 16, 32), (4, 8), (1, 2, 3), (4, 8)):
            try:
                us = bench(lambda: _gather_row_kernel[(splits, bs)](k, v, res, table, seq_lens, order, table.stride(0),
                           HKV=HKV, D=D, BLOCK_N=blk, SPLITS=splits, num_warps=warps, num_stages=stages))  # fmt: skip
                print(f"   row split {splits} blk {blk:>3} w {warps} st {stages}: {us:7.1f} us {nbytes / us / 1e6:.2f} TB/s")
            except Exception as exc:
                print(f"   row split {splits} blk {blk} w {warps} st {stages}: {type(exc).__name__}")


def readbw(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> None:
    x = k.view(-1)
    n = x.numel()
    print(f"buffer {x.numel() * 2 / 1e9:.1f} GB: torch sum {x.numel() * 2 / bench(lambda: x.sum()) / 1e6:.2f} TB/s")
    for block, warps, programs in itertools.product((2048, 4096, 8192), (4, 8), (132 * 4, 132 * 8, 132 * 16)):
        iters = triton.cdiv(n, block * programs)
        out = torch.empty(programs, device=k.device, dtype=torch.float32)
        us = bench(lambda: _read_kernel[(programs,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps))
        print(f"triton read block {block:>5} warps {warps} programs {programs:>5}: {n * 2 / us / 1e6:.2f} TB/s")


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    num_pages = 70_000  # like the engine's pool on an H200 (one layer's K and V: ~4.6 GB each)
    if "--layout" in sys.argv:
        layout(num_pages, dev)
        return
    k = torch.randn(num_pages * PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    modes = {"--graphs": graphs, "--pages": pages, "--ragged": ragged, "--workload": workload, "--extend": extend,
             "--readbw": readbw, "--gatherbw": gatherbw}  # fmt: skip
    for flag, mode in modes.items():
        if flag in sys.argv:
            mode(k, v, num_pages)
            return
    print(f"{'bs':>4} {'ctx':>5} {'splits':>6} {'blk':>4} {'w':>2} {'st':>2} {'us':>8} {'TB/s':>6}")
    for bs, ctx in SHAPES:
        table, rows, seq_lens, q, out, nbytes = make_batch([ctx] * bs, num_pages, dev)
        default_splits = decode_num_splits(bs, HKV, D, None, dev)
        results = []
        for splits, blk, warps, stages in itertools.product(
            sorted({default_splits, max(1, default_splits // 2), min(64, default_splits * 2)}), (32, 64, 128), (2, 4, 8), (2, 3, 4)
        ):
            if splits > 1 and ctx // splits < 64:
                continue
            try:
                us = bench(lambda: decode_attention(q, k, v, table, rows, seq_lens, 0.088, num_splits=splits,
                                                    out=out, block_n=blk, num_warps=warps, num_stages=stages))  # fmt: skip
            except Exception as exc:  # out of shared memory for big tiles x stages
                print(f"  skip splits={splits} blk={blk} w={warps} st={stages}: {type(exc).__name__}")
                continue
            results.append((us, splits, blk, warps, stages))
        default = next(r for r in results if r[1:] == (default_splits, 64, 2, 2 if default_splits == 1 else 3))
        for tag, (us, splits, blk, warps, stages) in [("default", default)] + [("", r) for r in sorted(results)[:4]]:
            print(f"{bs:>4} {ctx:>5} {splits:>6} {blk:>4} {warps:>2} {stages:>2} {us:>8.1f} {nbytes / us / 1e6:>6.2f} {tag}")


if __name__ == "__main__":
    main()
