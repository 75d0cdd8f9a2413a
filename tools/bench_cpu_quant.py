"""Micro-benchmark of the quantized CPU GEMV (kernels/cpu_quant.py) on SmolLM2-135M's shapes.

Decode reads every weight once per token, so what matters is the weight bytes streamed per second.
Each measurement cycles over enough copies of the matrix to fill `--working-set-mb` (default 128,
more than the model's 98 MB), so the bytes come from memory or the last-level cache as in a decode
step, not from L1/L2. Printed per path and type: us per call and GB/s of weight bytes read (with --rows > 8, the GEMM),
against a memory-bandwidth floor (a torch fp32 sum over `--floor-mb`) and torch's fp32 matmul
on the dequantized weights (4-6x more bytes). Findings: docs/performance.md, "Quantized CPU kernels".

    PYTHONPATH=$PWD python tools/bench_cpu_quant.py [--types Q4_1,Q8_0] [--rows 1] [--threads 2]
    PYTHONPATH=$PWD python tools/bench_cpu_quant.py --threads 1 --cpu-time   # on a loaded machine
    PYTHONPATH=$PWD python tools/bench_cpu_quant.py --step --threads 2 --isas avx2 --ab OTHER.so  # a step, A/B
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from minisgl.kernels import cpu_quant
from minisgl.kernels.quant_ref import QUANT_TYPES, QuantType, dequantize_ref

# (name, K, N): y[N] = W[N, K] x[K]
SHAPES = [("q/o 576x576", 576, 576), ("k/v 192x576", 576, 192), ("gate/up 1536x576", 576, 1536),
          ("down 576x1536", 1536, 576), ("lm_head 49152x576", 576, 49152)]  # fmt: skip


def random_blocks(q: QuantType, n: int, k: int) -> torch.Tensor:
    nb = n * (k // q.block_size)
    blocks = torch.randint(0, 256, (nb, q.type_size), dtype=torch.uint8)
    offsets = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[q.name]
    for off in offsets:
        blocks[:, off : off + 2] = (torch.randn(nb) * 0.02).half().view(torch.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


CLOCK: Callable[[], float] = time.perf_counter


def timed_ab(fns: list[Callable[[int], object]], calls: int, min_s: float = 0.15, rounds: int = 3,
             clocks: tuple[Callable[[], float], ...] | None = None) -> list[float]:  # fmt: skip
    """Seconds per call of each fn: the best of `rounds` rounds of `calls` calls (at least min_s per
    round), the fns' rounds interleaved (A/B in one process: a load change hits both alike).
    With `clocks`, the best per fn and clock: [fn0 clock0, fn0 clock1, ..., fn1 clock0, ...]."""
    clocks = clocks or (CLOCK,)
    for fn in fns:
        fn(0)
    best = [float("inf")] * (len(fns) * len(clocks))
    for _ in range(rounds):
        for f, fn in enumerate(fns):
            n, starts = 0, [c() for c in clocks]
            while True:
                fn(n)
                n += 1
                if n >= calls and clocks[0]() - starts[0] >= min_s:
                    break
            for j, c in enumerate(clocks):
                best[f * len(clocks) + j] = min(best[f * len(clocks) + j], (c() - starts[j]) / n)
    return best


# The quantized matmuls of one decode step of the embedded model (SmolLM2-135M, Q4_1 layers, Q8_0
# tied LM head): 30 x (q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536) + lm_head = 121.
STEP = [("Q4_1", 576, 960), ("Q4_1", 576, 576), ("Q4_1", 576, 3072), ("Q4_1", 1536, 576)] * 30 + [
    ("Q8_0", 576, 49152)]  # fmt: skip


def step_bench(libs: list[cpu_quant.QuantLib], isas: list[str], rows: int, rounds: int) -> None:
    """--step: a whole step's 121 calls (96 MB of distinct blocks, as the model reads per token),
    timed per path on each build, interleaved: wall and the calling thread's CPU time."""
    mats = [(cpu_quant.QuantMatrix.create(random_blocks(QUANT_TYPES[t], n, k), t), k) for t, k, n in STEP]
    mb = sum(qm.weight.numel() for qm, _ in mats) / 1e6
    xs = {k: torch.randn(rows, k) for _, k in mats}
    mode = 0 if rows <= cpu_quant.GEMV_MAX_ROWS else 1
    names = ["base", "this"] if len(libs) == 2 else ["this"]
    print(f"one step's {len(mats)} quantized matmuls, {mb:.1f} MB of blocks, rows={rows}, "
          f"threads={torch.get_num_threads()}, best of {rounds} interleaved rounds")  # fmt: skip
    for isa in isas:
        fns = []
        for lb in libs:
            iid = lb.isa_id(isa)  # type: ignore[arg-type]
            fns.append(lambda _, lb=lb, iid=iid: [lb.run(xs[k], qm, iid, mode) for qm, k in mats])
        secs = timed_ab(fns, 3, min_s=0.3, rounds=rounds, clocks=(time.perf_counter, time.thread_time))
        cells = [f"{name} {secs[2 * i] * 1e3:7.2f} ms wall ({mb / 1e3 / secs[2 * i]:5.1f} GB/s), "
                 f"{secs[2 * i + 1] * 1e3:7.2f} ms caller cpu" for i, name in enumerate(names)]  # fmt: skip
        ratio = f"  x{secs[0] / secs[2]:.2f} wall, x{secs[1] / secs[3]:.2f} cpu" if len(libs) == 2 else ""
        print(f"{isa:8} " + " | ".join(cells) + ratio, flush=True)


def timed(fn: Callable[[int], object], calls: int, min_s: float = 0.15) -> float:
    """Seconds per call: the best of 3 rounds of `calls` calls (at least min_s per round)."""
    return timed_ab([fn], calls, min_s)[0]


def bandwidth_floor(mb: int) -> float:
    t = torch.ones(mb * 2**20 // 4)
    sec = timed(lambda _: t.sum(), 3)
    return t.numel() * 4 / sec / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(QUANT_TYPES))
    ap.add_argument("--isas", default="", help="comma list (default: every path this CPU runs)")
    ap.add_argument("--rows", type=int, default=1,
                    help="activation rows (1 = single-stream decode; above 8 the GEMM, as quant_matmul)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--working-set-mb", type=int, default=128)
    ap.add_argument("--floor-mb", type=int, default=512)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch fp32 comparison")
    ap.add_argument("--ab", default="",
                    help="another build of the kernels (a minisgl_quant.so, e.g. main's under ~/.cache/minisgl/cpu_quant): "
                         "each path timed on it ('base') and on this one, interleaved, with the speed-up")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step", action="store_true", help="time a decode step's 121 calls instead of each shape")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with this thread's CPU time (needs --threads 1): on a shared, loaded machine "
                         "it leaves out the time other processes hold the core")  # fmt: skip
    args = ap.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            ap.error("--cpu-time needs --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    lib = cpu_quant.load_library()
    other = cpu_quant.QuantLib(args.ab) if args.ab else None
    isas = [i for i in args.isas.split(",") if i] or list(reversed(lib.supported))
    if args.step:
        step_bench([other, lib] if other else [lib], isas, args.rows, args.rounds)
        return
    floor = bandwidth_floor(args.floor_mb)
    print(f"clock={'thread cpu time' if args.cpu_time else 'wall'} threads={args.threads} rows={args.rows} paths={','.join(isas)} working set {args.working_set_mb} MB; "
          f"memory floor (torch fp32 sum of {args.floor_mb} MB): {floor:.1f} GB/s")  # fmt: skip
    heads = [f"{'base ' + i + ' us':>16} {'GB/s':>5} {i + ' us':>10} {'GB/s':>5} {'x':>5}" for i in isas] if other else [
        f"{i + ' us':>11} {'GB/s':>5}" for i in isas]
    print(f"{'type':5} {'shape':18} {'MB':>6} " + " ".join(heads)
          + ("" if args.no_torch else f" {'torch-f32 us':>12} {'GB/s':>5}"))  # fmt: skip
    ws = args.working_set_mb * 2**20
    for tname in args.types.split(","):
        q = QUANT_TYPES[tname]
        for label, k, n in SHAPES:
            if k % q.block_size:
                continue
            base = random_blocks(q, n, k)
            nbytes = base.numel()
            copies = [base] + [base.clone() for _ in range(max(0, min(ws // nbytes, 512) - 1))]
            x = torch.randn(args.rows, k)
            cells = []
            mode = "gemv" if args.rows <= cpu_quant.GEMV_MAX_ROWS else "gemm"
            for isa in isas:
                libs = [other, lib] if other else [lib]
                fns = [lambda i, x=x, c=copies, t=tname, a=isa, m=mode, lb=lb: lb.matmul(x, c[i % len(c)], t, a, m)
                       for lb in libs]  # fmt: skip
                secs = timed_ab(fns, len(copies), rounds=args.rounds)
                cell = " ".join(f"{sec * 1e6:{16 if j == 0 and other else 10 if other else 11}.1f} {nbytes / sec / 1e9:5.1f}"
                                for j, sec in enumerate(secs))  # fmt: skip
                cells.append(cell + (f" {secs[0] / secs[1]:5.2f}" if other else ""))
            if not args.no_torch:
                wf = dequantize_ref(base, tname)
                fcopies = [wf] + [wf.clone() for _ in range(max(0, min(ws // (wf.numel() * 4), 512) - 1))]
                sec = timed(lambda i, x=x, c=fcopies: x @ c[i % len(c)].T, len(fcopies))
                cells.append(f"{sec * 1e6:12.1f} {wf.numel() * 4 / sec / 1e9:5.1f}")
                del fcopies, wf
            print(f"{tname:5} {label:18} {nbytes / 2**20:6.2f} " + " ".join(cells), flush=True)
            del copies


if __name__ == "__main__":
    main()
