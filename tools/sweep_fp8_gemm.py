"""The FP8 W8A8 GEMM (kernels/fp8_gemm.py) against bf16 cuBLAS on Qwen3-8B's four projections
(issue 25: the 8B shape ran 3.3x slower with 128x128-block FP8 weights than with bf16, 1.2x
slower per channel, and bs=1 decode no faster, where half the weight bytes should make it
faster).

For each projection (qkv 4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096) and
row count M it prints, in us per call: the bandwidth floor (weight + activation bytes at 4.2 TB/s,
float8 weights), bf16 F.linear, the activation quantizer alone (per token; per token and 128-group),
the Triton GEMM at the launch `gemm_config` picks today (per channel; grouped), the best launch of
a small sweep (tiles, warps, stages, and `promote_every` 32 vs Triton's default accumulation) with
its error against the float64 product of the same float8 operands, and torch._scaled_mm (cuBLASLt
float8, row-wise scales) where this torch has it. The last table sums the four GEMMs of a layer.

Times are in-graph (tools/sweep_gemm.py's `graph_us`: one CUDA graph of back-to-back calls that
rotate over weight copies of ~200 MB, so each call reads its weight from HBM as a decode step does).

GPU: `python tools/sweep_fp8_gemm.py [--rows 1,16,64,256,2048] [--budget 240]` (the sweep stops
adding launches when the budget runs out and says so). Without CUDA: a self-check of every path on
a tiny shape under the Triton interpreter ("cpu self-check passed").

Research tool, not product code. Findings: docs/performance.md, "FP8 GEMM launches".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()  # before triton is imported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.nn.functional as F  # noqa: E402

from minisgl.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, fp8_quantize, gemm_config, promote_for  # noqa: E402
from minisgl.kernels.fp8_ref import dequantize_fp8, quantize_fp8, quantize_weight_blocks  # noqa: E402

SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
HBM_BPS = 4.2e12
ROTATE_BYTES = 200e6


def launches(m: int) -> list[tuple[Fp8GemmConfig, int | None]]:
    """The sweep's launches for m rows: (config, promote_every)."""
    if m <= 16:
        tiles = [(16, bn, 4, st) for bn in (16, 32, 64, 128) for st in (4, 6)]
    elif m <= 64:
        tiles = [(bm, bn, 4, st) for bm in (32, 64) for bn in (64, 128) for st in (3, 4)]
    else:
        tiles = [(bm, bn, w, 3) for bm in (64, 128) for bn in (128, 256) for w in (4, 8)]
    return [(Fp8GemmConfig(*t), p) for t in tiles for p in (32, None)]


def weights(n: int, k: int, group: int | None, copies: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(copies):
        w = torch.randn(n, k, device=device, generator=torch.Generator(device).manual_seed(i)) * 0.02
        if group is None:
            out.append(quantize_fp8(w))
        else:
            qw, blocks = quantize_weight_blocks(w, (128, 128))
            out.append((qw, blocks.repeat_interleave(128, dim=0)[:n].contiguous()))
    return out


def rel_error(out: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, qw: torch.Tensor, ws: torch.Tensor,
              group: int | None) -> float:  # fmt: skip
    exact = dequantize_fp8(xq, xs, group).double() @ dequantize_fp8(qw, ws, group).double().t()
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, qw: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """cuBLASLt float8 with row-wise scales (x per token, W per output row), bf16 out."""
    return torch._scaled_mm(xq, qw.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)


def run_gpu(rows: list[int], budget: float) -> None:
    from sweep_gemm import graph_us

    start = time.monotonic()
    totals: dict[tuple[int, str], float] = {}
    print(f"{'shape':8} {'M':>5} {'floor':>7} {'bf16':>7} {'quant':>7} {'quant/g':>7} | {'pc now':>7} {'pc best':>7} "
          f"{'launch':>22} {'err':>8} | {'grp now':>7} {'grp best':>8} {'launch':>22} {'err':>8} | {'scaled_mm':>9}")  # fmt: skip
    for name, n, k in SHAPES_8B:
        copies = max(2, int(ROTATE_BYTES // (n * k)))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(2, copies // 2))]
        per_group = {g: weights(n, k, g, copies, "cuda") for g in (None, 128)}
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor = (n * k + m * k * 2 + m * n * 2) / HBM_BPS * 1e6
            bf16 = graph_us([lambda w=w: F.linear(x, w) for w in w16])
            quant = {g: graph_us([lambda g=g: fp8_quantize(x, g)] * 8) for g in (None, 128)}
            cells = [f"{name:8} {m:>5} {floor:>7.1f} {bf16:>7.1f} {quant[None]:>7.1f} {quant[128]:>7.1f}"]
            for group in (None, 128):
                xq, xs = fp8_quantize(x, group)
                ws_list = per_group[group]

                def timed(cfg: Fp8GemmConfig | None, promote: int | None | str = "auto") -> float:
                    return graph_us([lambda qw=qw, ws=ws: fp8_gemm(xq, xs, qw, ws, group, torch.bfloat16, config=cfg,
                                                                   promote_every=promote) for qw, ws in ws_list])  # fmt: skip

                now = timed(None)
                best = (now, gemm_config(m, n, group is not None), promote_for(group, torch.bfloat16))
                for cfg, promote in launches(m):
                    if time.monotonic() - start > budget:
                        break
                    try:
                        us = timed(cfg, promote)
                    except Exception as e:  # out of shared memory, a failed compile
                        print(f"  (skipped {cfg} promote {promote}: {type(e).__name__})")
                        continue
                    if us < best[0]:
                        best = (us, cfg, promote)
                qw, ws = ws_list[0]
                err = rel_error(fp8_gemm(xq, xs, qw, ws, group, torch.float32, config=best[1], promote_every=best[2]),
                                xq, xs, qw, ws, group)  # fmt: skip
                c = best[1]
                launch = f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} p{best[2]}"
                cells.append(f"{now:>7.1f} {best[0]:>7.1f} {launch:>22} {err:>8.1e}")
                totals[(m, "pc now" if group is None else "grp now")] = totals.get((m, "pc now" if group is None else "grp now"), 0) + now
                totals[(m, "pc best" if group is None else "grp best")] = totals.get((m, "pc best" if group is None else "grp best"), 0) + best[0]
            try:
                xq, xs = fp8_quantize(x, None)
                sm = graph_us([lambda qw=qw, ws=ws: scaled_mm(xq, xs, qw, ws) for qw, ws in per_group[None]])
                cells.append(f"{sm:>9.1f}")
                totals[(m, "scaled_mm")] = totals.get((m, "scaled_mm"), 0) + sm
            except Exception as e:
                cells.append(f"{type(e).__name__:>9}")
            totals[(m, "bf16")] = totals.get((m, "bf16"), 0) + bf16
            totals[(m, "floor")] = totals.get((m, "floor"), 0) + floor
            totals[(m, "quant")] = totals.get((m, "quant"), 0) + quant[None]
            print(" | ".join(cells), flush=True)
        del w16, per_group
        torch.cuda.empty_cache()
    print("\nper layer (the four GEMMs summed), us; quant = the per-token quantizer once per GEMM:")
    keys = ["floor", "bf16", "quant", "pc now", "pc best", "grp now", "grp best", "scaled_mm"]
    print(f"{'M':>5} " + " ".join(f"{key:>10}" for key in keys))
    for m in rows:
        print(f"{m:>5} " + " ".join(f"{totals.get((m, key), float('nan')):>10.1f}" for key in keys))
    if time.monotonic() - start > budget:
        print(f"(budget {budget:.0f} s ran out: later shapes swept fewer launches)")


def self_check() -> None:
    """Each path once on a tiny shape under the interpreter, against the float64 product."""
    x = torch.randn(100, 1000)  # the shape of tests/kernels/test_fp8_gemm_shapes.py
    for group in (None, 128):
        (qw, ws), = weights(64, 1000, group, 1, "cpu")
        xq, xs = fp8_quantize(x, group)
        for cfg, promote in [(None, 32), (Fp8GemmConfig(64, 32, 4, 4), None)]:
            out = fp8_gemm(xq, xs, qw, ws, group, torch.float32, config=cfg, promote_every=promote)
            assert rel_error(out, xq, xs, qw, ws, group) < 1e-5, (group, cfg)
    print("cpu self-check passed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,2048", help="comma-separated row counts M")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the launch sweep")
    args = parser.parse_args()
    if torch.cuda.is_available():
        run_gpu([int(r) for r in args.rows.split(",")], args.budget)
    else:
        self_check()
