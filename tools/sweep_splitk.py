"""Split-K Triton GEMM (`kernels/gemm.py`) against cuBLAS on Qwen3-0.6B's decode projections.

For o_proj and down_proj (N = 1024) the baseline is what the folded-norm layer runs today, the
in-place `hidden.addmm_(x, W.T)` (its graph carries a memcpy node per call), and the Triton kernel
adds the residual itself; qkv and gate_up compare with `F.linear`. For each projection and
decode batch M it prints cuBLAS, the kernel's default launch, the best swept launch, and at the
end the per-layer sums and the best launch per (projection, M) as a table for `kernels/gemm.py`.

Times are in-graph (`sweep_gemm.graph_us`: 20 calls back to back over rotating copies of W, so W
comes from HBM as in a decode step), us per call. Compiling ~200 variants dominates the run, so
`--jobs N` first compiles them in N processes (Triton's disk cache), then times in this one.

GPU: `python tools/sweep_splitk.py [--jobs 8] [--shapes o,down] [--batches 64,160]`.
Without CUDA: a self-check of a few launches under the Triton interpreter.

Research tool, not product code. Findings: docs/performance.md, section "Split-K GEMM for small
decode batches" (the launches in kernels/gemm.py's table).
"""

from __future__ import annotations

import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit, so before triton is imported

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from sweep_gemm import CALLS, ROTATE_BYTES, compile_in_jobs, graph_us, run_split_k_sweep  # noqa: E402

from minisgl.kernels.gemm import GemmConfig, default_config, splitk_gemm  # noqa: E402

# name: (N, K, adds the residual)
SHAPES = {
    "qkv": (4096, 1024, False),
    "o": (1024, 2048, True),
    "gate_up": (6144, 1024, False),
    "down": (1024, 3072, True),
}
BATCHES = (1, 16, 32, 64, 96, 128, 160, 192, 256)


def configs(M: int, N: int, K: int, sms: int) -> list[GemmConfig]:
    out = []
    bms = [16] if M <= 16 else [32] if M <= 32 else [32, 64] if M <= 64 else [64, 128]
    for bm, bn, bk in itertools.product(bms, (32, 64, 128), (64, 128)):
        if N % bn:
            continue
        tiles = triton.cdiv(M, bm) * N // bn
        for split in (1, 2, 4, 8, 16):
            if K % (bk * split * 2) and split > 1:
                continue
            if split == 1 or sms // 2 <= tiles * split <= 3 * sms:
                out.append(GemmConfig(bm, bn, bk, split, 8 if bm * bn >= 128 * 64 else 4, 4 if bk == 64 else 3))
    return out


def check(y: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(y.float() / scale, ref.float() / scale, rtol=2e-2, atol=2e-2)


def cases(shapes: list[str], batches: list[int], sms: int):
    for name in shapes:
        N, K, residual = SHAPES[name]
        for M in batches:
            yield name, N, K, residual, M, [default_config(M, N, K, torch.device("cuda")), *configs(M, N, K, sms)]


def compile_only(shapes: list[str], batches: list[int], part: int, parts: int, sms: int) -> None:
    """Launch every config once (fills Triton's cache); this process's share of them."""
    todo = sorted({(name, M, cfg) for name, _, _, _, M, cfgs in cases(shapes, batches, sms) for cfg in cfgs})
    for i, (name, M, cfg) in enumerate(todo):
        if i % parts != part:
            continue
        N, K, residual = SHAPES[name]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        r = torch.zeros(M, N, device="cuda", dtype=torch.bfloat16) if residual else None
        try:
            splitk_gemm(x, w, residual=r, out=r, config=cfg)
        except Exception as exc:  # out of shared memory, ...
            print(f"  compile failed {name} {cfg}: {type(exc).__name__}", flush=True)
    torch.cuda.synchronize()


def main(shapes: list[str], batches: list[int], jobs: int) -> None:
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if jobs > 1:
        compile_in_jobs(__file__, shapes, batches, jobs)
    rows: dict[tuple[str, int], tuple[float, float, float, GemmConfig]] = {}
    current = None
    for name, N, K, residual, M, cfgs in cases(shapes, batches, sms):
        if current != name:
            copies = max(1, min(CALLS, ROTATE_BYTES // (N * K * 2)))
            weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
            current = name
            print(f"== {name}: N={N} K={K}{' + residual' if residual else ''}, {copies} weight copies, us per call")
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        hidden = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ weights[0].float().T + (hidden.float() if residual else 0)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        if residual:  # the engine's op; hidden drifts over the replays, which does not change the time
            base = graph_us([lambda i=i: hidden.addmm_(x, weights[i % len(weights)].T) for i in range(CALLS)])
        else:
            base = graph_us([lambda i=i: F.linear(x, weights[i % len(weights)]) for i in range(CALLS)])
        results = []
        for j, cfg in enumerate(cfgs):
            if j > 0 and cfg == cfgs[0]:
                continue

            def run(i: int, cfg: GemmConfig = cfg) -> None:
                w = weights[i % len(weights)]
                if residual:
                    splitk_gemm(x, w, residual=hidden, out=hidden, config=cfg)
                else:
                    splitk_gemm(x, w, out=y, config=cfg)

            try:
                if residual:
                    hidden_copy = hidden.clone()
                    splitk_gemm(x, weights[0], residual=hidden_copy, out=y, config=cfg)
                    check(y, x.float() @ weights[0].float().T + hidden_copy.float())
                else:
                    run(0)
                    check(y, ref)
                us = graph_us([lambda i=i: run(i) for i in range(CALLS)])
            except Exception as exc:
                print(f"  skip {name} M={M} [{cfg}]: {type(exc).__name__}: {(str(exc) or ' ').splitlines()[0][:100]}")
                continue
            results.append((us, j == 0, cfg))
        default = next((r for r in results if r[1]), None)
        best = min(results, key=lambda r: r[0]) if results else None
        floor = (N * K + M * K + M * N * (2 if residual else 1)) * 2 / 4.2e12 * 1e6
        row = f"{name:>8} M={M:>4} floor {floor:5.1f} | cuBLAS {base:6.2f}"
        if default:
            row += f" | default {default[0]:6.2f} [{default[2]}]"
        if best:
            row += f" | best {best[0]:6.2f} [{best[2]}] x{base / best[0]:.2f}"
            rows[name, M] = (base, default[0] if default else float("nan"), best[0], best[2])
        print(row, flush=True)
    print(f"== per layer ({' + '.join(shapes)}), us: cuBLAS | Triton default | best of Triton and cuBLAS per shape")
    for M in batches:
        if all((n, M) in rows for n in shapes):
            cublas = sum(rows[n, M][0] for n in shapes)
            default = sum(rows[n, M][1] for n in shapes)
            best = sum(min(rows[n, M][0], rows[n, M][2]) for n in shapes)
            print(f"M={M:>4} {cublas:7.2f} | {default:7.2f} | {best:7.2f} (x{cublas / best:.2f})")
    print("== best launch per (N, K, M) where Triton beats cuBLAS:")
    for (name, M), (base, _, best, cfg) in sorted(rows.items()):
        if best < base:
            N, K, _ = SHAPES[name]
            print(f"    ({N}, {K}, {M}): GemmConfig{tuple(cfg)},  # {name}: {best:.2f} vs cuBLAS {base:.2f} us")


def self_check() -> None:
    torch.manual_seed(0)
    N, K = 64, 256
    for dtype, M, split in itertools.product((torch.float16, torch.float32), (3, 20), (1, 2)):
        w = torch.randn(N, K).to(dtype) / K**0.5
        x = torch.randn(M, K).to(dtype)
        r = torch.randn(M, N).to(dtype)
        ref = x.float() @ w.float().T + r.float()
        splitk_gemm(x, w, residual=r, out=r, config=GemmConfig(16, 32, 64, split, 4, 2))
        check(r, ref)
    print("cpu self-check passed")


if __name__ == "__main__":
    run_split_k_sweep(__doc__, list(SHAPES), BATCHES, self_check, compile_only, main)
