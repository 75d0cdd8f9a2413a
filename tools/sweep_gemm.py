"""Triton skinny GEMM vs cuBLAS on the decode GEMMs of Qwen3-0.6B (bf16, y = x @ W.T, W [N, K]).

For each projection (qkv, o, gate_up, down, lm_head) and decode batch M it prints the bandwidth
floor (bytes of W + x + y at 4.2 TB/s), F.linear (cuBLAS) and the best of a small sweep of
`_gemm_kernel` launches (tiles, split-K, stages), twice: the GEMM stage alone and with split-K's
partial-sum kernel (the sum could be folded into the following residual-add + RMSNorm). gate_up is
also run as `_gemm_silu_kernel`, which writes silu(gate) * up itself (weight rows interleaved by
half tiles), against F.linear + silu-and-mul. The summary adds up the four per-layer GEMMs per M.

Times are in-graph: one CUDA graph of 20 back-to-back calls, replayed 5 times (median), us per
call, so the gap between kernels counts as in a captured decode step. The 20 calls rotate over
copies of W (~200 MB in all) so that each call reads W from HBM as a decode step does: one layer's
W alone would stay in the ~50 MB L2 between calls. Configs that fail to compile or check are
listed as skipped.

GPU: `bash tools/gpu_run.sh gemm`, or `python tools/sweep_gemm.py [--quick]` (--quick: M in
1, 64, 256 and fewer configs). Without CUDA it checks every kernel on tiny shapes under the Triton
interpreter instead and prints "cpu self-check passed".

Research tool, not product code. Findings: docs/performance.md, sections "Split-K GEMM for small
decode batches" and "Tried and lost" (a Triton GEMM above 64 rows or for qkv/gate_up).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
from typing import Callable, NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit, so before triton is imported

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)}
LAYER = ("qkv", "o", "gate_up", "down")
BATCHES = (1, 8, 16, 32, 64, 128, 192, 256)
HBM_BYTES_PER_S = 4.2e12
CALLS, REPLAYS = 20, 5
ROTATE_BYTES = 200 << 20  # weight copies per graph: ~4x L2
_SUM_BLOCK = 1024

try:  # the engine's one-launch silu_and_mul, the baseline beside torch's silu * mul (repo on PYTHONPATH)
    from minisgl.kernels.activation import silu_and_mul
except ImportError:
    silu_and_mul = None


class Cfg(NamedTuple):
    bm: int
    bn: int
    bk: int
    split: int
    warps: int
    stages: int

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk} split{self.split} w{self.warps} st{self.stages}"


@triton.jit
def _dot_tile(x_ptr, w_ptr, M, pid_m, pid_n, pid_k, K: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ W.T over split pid_k of K (rows of x past M read as 0)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * (K // SPLIT_K) + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K // SPLIT_K, BLOCK_K):
        x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


# M changes every call: not specialised. pid_m runs fastest, so the CTAs reading one W tile run together.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """y [M, N] = x @ W.T; with SPLIT_K > 1, y is an fp32 workspace [SPLIT_K, M, N] of partial sums."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = _dot_tile(x_ptr, w_ptr, M, pid_m, pid_n, pid_k, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(ws_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum of the SPLIT_K partials in ws [SPLIT_K, numel] (fp32), in y's dtype; fixed order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gemm_silu_kernel(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """y [M, N / 2] = silu(gate) * up from x @ W.T, where W's tile j of BLOCK_N rows holds gate rows
    [j * BLOCK_N / 2, (j + 1) * BLOCK_N / 2) then the same up rows (see `interleave`)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = _dot_tile(x_ptr, w_ptr, M, pid_m, pid_n, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, 1)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    # Rounded as the unfused path does (bf16 GEMM output, silu rounded before the product).
    dtype = y_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = silu * up.to(dtype).to(tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + offs_m[:, None] * (N // 2) + offs_n[None, :], out.to(dtype), mask=offs_m[:, None] < M)


def gemm(x: torch.Tensor, w: torch.Tensor, cfg: Cfg, y: torch.Tensor, ws: torch.Tensor | None, reduce: bool = True) -> None:
    """y [M, N] bf16 = x @ w.T; split-K partials go to ws [split, M, N] fp32, summed into y if reduce."""
    (M, K), N = x.shape, w.shape[0]
    assert N % cfg.bn == 0 and K % (cfg.bk * cfg.split) == 0, f"N={N}, K={K} not divisible for {cfg}"
    assert max(N * K, cfg.split * M * N) < 2**31, "kept within int32 element offsets"
    grid = (triton.cdiv(M, cfg.bm), N // cfg.bn, cfg.split)
    _gemm_kernel[grid](
        x, w, y if cfg.split == 1 else ws, M, N,
        K=K, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, SPLIT_K=cfg.split, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    if cfg.split > 1 and reduce:
        _sum_splits_kernel[(triton.cdiv(M * N, _SUM_BLOCK),)](ws, y, M * N, SPLIT_K=cfg.split, BLOCK=_SUM_BLOCK, num_warps=4)


def gemm_silu(x: torch.Tensor, w2: torch.Tensor, cfg: Cfg, y: torch.Tensor) -> None:
    """y [M, N / 2] = silu(gate) * up, w2 = interleave([gate; up], cfg.bn)."""
    (M, K), N = x.shape, w2.shape[0]
    assert cfg.split == 1 and N % cfg.bn == 0 and K % cfg.bk == 0, f"N={N}, K={K} not divisible for {cfg}"
    _gemm_silu_kernel[(triton.cdiv(M, cfg.bm), N // cfg.bn)](
        x, w2, y, M, N, K=K, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip


def interleave(w: torch.Tensor, bn: int) -> torch.Tensor:
    """[gate; up] rows -> tile j of bn rows = gate rows [j * bn/2, (j + 1) * bn/2), then the same up rows."""
    gate, up = w.view(2, -1, bn // 2, w.shape[1]).unbind(0)
    return torch.stack([gate, up], dim=1).reshape(w.shape).contiguous()


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(y.float() / scale, ref.float() / scale, rtol=2e-2, atol=2e-2)


def configs(M: int, N: int, K: int, sms: int, quick: bool, silu: bool = False) -> list[Cfg]:
    """A few launches per M bucket. Split-K (with the first K block / stages pair only) where the tiles fill
    under half the SMs, up to 1.5 waves of programs and with at least two K blocks per split."""
    out = []
    for bm in [16] if M <= 16 else [32] if M <= 32 else [64] if M <= 64 else [64, 128]:
        bns = (32, 64, 128) if bm <= 32 else (64, 128)
        k_stages = ((128, 4), (256, 3)) if bm <= 32 else ((64, 4), (128, 3))
        if quick:
            bns, k_stages = bns[-2:], k_stages[:1]
        for bn, (bk, stages) in itertools.product(bns, k_stages):
            tiles = triton.cdiv(M, bm) * N // bn
            may_split = not silu and (bk, stages) == k_stages[0] and 2 * tiles < sms
            for split in (1, 2, 4) if may_split else (1,):
                if split == 1 or (tiles * split <= 1.5 * sms and K % (2 * bk * split) == 0):
                    out.append(Cfg(bm, bn, bk, split, 8 if bm * bn >= 128 * 128 else 4, stages))
    return out


def split_k_sweep_args(doc: str, shapes: list[str], batches: tuple[int, ...]) -> argparse.Namespace:
    """The split-K sweeps' command line: --shapes, --batches (parsed into lists), --jobs and the
    --compile-only / --part pair that `compile_in_jobs` passes to its processes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(shapes))
    parser.add_argument("--batches", default=",".join(map(str, batches)))
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes first")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--part", type=int, default=0)
    args = parser.parse_args()
    args.shapes, args.batches = args.shapes.split(","), [int(b) for b in args.batches.split(",")]
    return args


def run_split_k_sweep(doc: str, shapes: list[str], batches: tuple[int, ...], self_check: Callable[[], None],
                      compile_only: Callable[..., None], main: Callable[..., None]) -> None:  # fmt: skip
    """A split-K sweep script's entry point: without CUDA its CPU `self_check`; with
    --compile-only (a `compile_in_jobs` process) `compile_only(shapes, batches, part, parts, sms)`;
    else `main(shapes, batches, jobs)`."""
    args = split_k_sweep_args(doc, shapes, batches)
    if not torch.cuda.is_available():
        self_check()
    elif args.compile_only:
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        compile_only(args.shapes, args.batches, args.part, args.jobs, sm_count)
    else:
        main(args.shapes, args.batches, args.jobs)


def compile_in_jobs(script: str, shapes: list[str], batches: list[int], jobs: int) -> None:
    """Run `script --compile-only --part i` in `jobs` processes (each compiles its share of the
    launches into Triton's disk cache), for the sweeps whose compiles dominate their run time."""
    base = [sys.executable, script, "--compile-only", "--shapes", ",".join(shapes),
            "--batches", ",".join(map(str, batches)), "--jobs", str(jobs)]  # fmt: skip
    procs = [subprocess.Popen([*base, "--part", str(i)]) for i in range(jobs)]
    assert all(p.wait() == 0 for p in procs), "a compile job failed"


def graph_us(calls: list[Callable[[], object]]) -> float:
    """us per call: one CUDA graph of the calls back to back, median of REPLAYS replays."""
    calls[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def torch_silu_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def sweep(name: str, M: int, weights: list[torch.Tensor], sms: int, quick: bool) -> tuple[float, ...]:
    """Prints one row; returns us per call: (cuBLAS [+ torch silu*mul], best Triton GEMM stage, best Triton with
    the split-K sum or fused SiLU, cuBLAS + the engine's silu_and_mul for gate_up+silu or else nan)."""
    silu = name.endswith("+silu")
    (N, K), interleaved = weights[0].shape, {}
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = torch_silu_mul(F.linear(x, weights[0])) if silu else x.float() @ weights[0].float().T
    y = torch.empty(M, N // 2 if silu else N, device="cuda", dtype=torch.bfloat16)
    epilogue = torch_silu_mul if silu else lambda h: h
    base = graph_us([lambda i=i: epilogue(F.linear(x, weights[i % len(weights)])) for i in range(CALLS)])
    engine = float("nan")
    if silu and silu_and_mul is not None:
        engine = graph_us([lambda i=i: silu_and_mul(F.linear(x, weights[i % len(weights)])) for i in range(CALLS)])
    results = []
    for cfg in configs(M, N, K, sms, quick, silu):
        ws = torch.empty(cfg.split, M, N, device="cuda", dtype=torch.float32) if cfg.split > 1 else None
        if silu and cfg.bn not in interleaved:
            interleaved[cfg.bn] = [interleave(w, cfg.bn) for w in weights]
        w2 = interleaved[cfg.bn] if silu else weights

        def run(i: int, reduce: bool, cfg: Cfg = cfg, ws: torch.Tensor | None = ws, w2: list = w2) -> None:
            if silu:
                gemm_silu(x, w2[i % len(w2)], cfg, y)
            else:
                gemm(x, w2[i % len(w2)], cfg, y, ws, reduce)

        try:
            run(0, True)
            assert_close(y, ref)
            stage = graph_us([lambda i=i: run(i, False) for i in range(CALLS)])
            total = stage if cfg.split == 1 else graph_us([lambda i=i: run(i, True) for i in range(CALLS)])
        except Exception as exc:  # out of shared memory, failed check, ...
            print(f"  skip {name} M={M} [{cfg}]: {type(exc).__name__}: {(str(exc) or ' ').splitlines()[0][:100]}")
            continue
        results.append((total, stage, cfg))
    floor = (N * K + M * K + y.numel()) * 2 / HBM_BYTES_PER_S * 1e6
    row = f"{name:>12} {M:>4} floor {floor:6.1f} | {'cuBLAS+silu*mul' if silu else 'cuBLAS'} {base:7.1f}"
    if silu and silu_and_mul is not None:
        row += f" | cuBLAS+silu_and_mul {engine:7.1f}"
    if not results:
        print(f"{row} | no Triton config ran")
        return base, float("inf"), float("inf"), engine
    (total, _, total_cfg), (_, stage, stage_cfg) = min(results), min(results, key=lambda r: r[1])
    if not silu:
        row += f" | gemm {stage:7.1f} [{stage_cfg}]"
    print(f"{row} | {'fused' if silu else '+sum'} {total:7.1f} [{total_cfg}] | x{base / total:.2f}")
    return base, stage, total, engine


def main(quick: bool) -> None:
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batches = (1, 64, 256) if quick else BATCHES
    rows = {}
    for name in (*SHAPES, "gate_up+silu"):
        N, K = SHAPES[name.split("+")[0]]
        copies = max(1, min(CALLS, ROTATE_BYTES // (N * K * 2)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        print(f"== {name}: N={N} K={K}, {copies} weight copies; us per call [BMxBNxBK split warps stages]")
        for M in batches:
            rows[name, M] = sweep(name, M, weights, sms, quick)
        del weights
        torch.cuda.empty_cache()
    print(f"== per layer ({' + '.join(LAYER)}), us: cuBLAS | Triton GEMM stages | Triton + split-K sums || "
          "gate_up: cuBLAS + silu*mul | cuBLAS + silu_and_mul | fused Triton")  # fmt: skip
    for M in batches:
        cublas, stage, total = (sum(rows[n, M][i] for n in LAYER) for i in range(3))
        gu_base, _, gu_fused, gu_engine = rows["gate_up+silu", M]
        print(f"M={M:>4} {cublas:7.1f} | {stage:7.1f} (x{cublas / stage:.2f}) | {total:7.1f} (x{cublas / total:.2f}) || "
              f"{gu_base:7.1f} | {gu_engine:7.1f} | {gu_fused:7.1f} (x{gu_base / gu_fused:.2f})")  # fmt: skip


def self_check() -> None:
    """Every kernel under the Triton interpreter on tiny shapes: two M tiles, split-K 1 and 2, fused SiLU. In
    fp16 and fp32: the interpreter's tl.dot mis-reads bf16 (the GPU sweep checks bf16 on every config)."""
    torch.manual_seed(0)
    N, K = 64, 128
    for dtype, M in itertools.product((torch.float16, torch.float32), (3, 20)):
        w = torch.randn(N, K).to(dtype) / K**0.5
        x = torch.randn(M, K).to(dtype)
        ref = x.float() @ w.float().T
        for split in (1, 2):
            y = torch.full((M, N), float("nan"), dtype=dtype)
            gemm(x, w, Cfg(16, 32, 32, split, 4, 2), y, torch.empty(split, M, N, dtype=torch.float32))
            assert_close(y, ref)
        gate, up = F.linear(x, w).chunk(2, dim=1)
        y = torch.full((M, N // 2), float("nan"), dtype=dtype)
        gemm_silu(x, interleave(w, 32), Cfg(16, 32, 32, 1, 4, 2), y)
        assert_close(y, F.silu(gate) * up)
    print("cpu self-check passed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M in 1, 64, 256 and fewer configs")
    args = parser.parse_args()
    main(args.quick) if torch.cuda.is_available() else self_check()
