"""Wide split-K launches for o_proj / down_proj at 65-256 decode rows, against cuBLAS.

`kernels/gemm.py`'s split-K kernel loses to cuBLAS above 64 rows (`sweep_splitk.py`): its M tiles
of 64-128 rows re-read W once per M tile, and the last program of a tile sums every split's
partial alone. This sweep tries what that one did not:
- all rows in one M tile of 128 or 256 (W read once);
- swapped operands (`SWAP`): the MMA's M side is W's N rows and the tokens are its N side, as
  cuBLAS does for skinny GEMMs;
- the split sum in a second small kernel over the whole output (`INLINE=0`), spread over every SM,
  instead of in the last program of each tile.

Times are in-graph, W from HBM, us per call (`sweep_gemm.graph_us`), with the in-place
`hidden.addmm_(x, W.T)` (the engine's op) as the baseline. Every launch is checked against it.

GPU: `python tools/sweep_splitk_wide.py [--jobs 12] [--batches 96,160,256]`.
Without CUDA: a self-check of a few launches under the Triton interpreter.

Research tool, not product code. Findings: docs/performance.md, "Tried and lost" (wider split-K
launches above 64 rows).
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit, so before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from sweep_gemm import CALLS, ROTATE_BYTES, compile_in_jobs, graph_us, run_split_k_sweep  # noqa: E402

SHAPES = {"o": (1024, 2048), "down": (1024, 3072)}
BATCHES = (96, 128, 160, 192, 256)
_SUM_BLOCK = 1024


class Wide(NamedTuple):
    bm: int
    bn: int
    bk: int
    split: int
    swap: bool
    inline: bool
    warps: int
    stages: int

    def __str__(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk} split{self.split} {'swap' if self.swap else 'mn'} "
                f"{'inline' if self.inline else 'sumk'} w{self.warps} st{self.stages}")  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _wide_kernel(x_ptr, w_ptr, out_ptr, res_ptr, part_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 SWAP: tl.constexpr, INLINE: tl.constexpr):  # fmt: skip
    """out [M, N] = x [M, K] @ W [N, K].T + res (all row-major, contiguous). With SPLIT_K > 1 and
    INLINE, the last program of a tile sums the splits' fp32 partials (workspace [split, tile]);
    without INLINE, every program writes its partial to part [split, M, N] and `_sum_kernel` adds."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * (K // SPLIT_K) + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    if SWAP:  # acc[n, m]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(0, K // SPLIT_K, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            acc = tl.dot(tl.load(w_ptrs), tl.trans(x), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        # element (n, m) of the tile: output offset m * N + n
        offs = offs_m[None, :] * N + offs_n[:, None]
        mask = m_mask[None, :]
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(0, K // SPLIT_K, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(tl.load(w_ptrs)), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        offs = offs_m[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None]
        tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if SPLIT_K == 1:
        acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif not INLINE:
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=mask)
    else:
        tile = pid_m * (N // BLOCK_N) + pid_n
        num_tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
        tl.store(part_ptr + (pid_k * num_tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            for s in tl.static_range(SPLIT_K):
                ptrs = part_ptr + (s * num_tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs
                acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _sum_kernel(part_ptr, res_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = res + the SPLIT_K fp32 partials of part [SPLIT_K, numel], summed in split order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def wide_gemm(x, w, res, out, cfg: Wide, parts, counts) -> None:
    (M, K), N = x.shape, w.shape[0]
    assert N % cfg.bn == 0 and K % (cfg.bk * cfg.split) == 0, f"N={N} K={K} do not divide for {cfg}"
    grid = (N // cfg.bn, triton.cdiv(M, cfg.bm), cfg.split)
    _wide_kernel[grid](x, w, out, res, parts, counts, M, N=N, K=K, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk,
                       SPLIT_K=cfg.split, SWAP=cfg.swap, INLINE=cfg.inline, num_warps=cfg.warps,
                       num_stages=cfg.stages)  # fmt: skip
    if cfg.split > 1 and not cfg.inline:
        _sum_kernel[(triton.cdiv(M * N, _SUM_BLOCK),)](parts, res, out, M * N, SPLIT_K=cfg.split, BLOCK=_SUM_BLOCK,
                                                       num_warps=4)  # fmt: skip


def configs(M: int, N: int, K: int, sms: int) -> list[Wide]:
    out = []
    bms = [b for b in (64, 128, 256) if b >= M // 2 and not (b == 64 and M > 128)]
    for bm, bn, bk, swap, inline in itertools.product(bms, (32, 64, 128), (64, 128), (False, True), (True, False)):
        if bm * bk > 128 * 128 or N % bn:
            continue
        tiles = triton.cdiv(M, bm) * N // bn
        for split in (1, 2, 4, 8, 16):
            if K % (bk * split) or (split == 1 and not inline):
                continue
            if not (sms // 2 <= tiles * split <= 2 * sms):
                continue
            warps = 8 if bm * bn >= 128 * 128 else 4
            out.append(Wide(bm, bn, bk, split, swap, inline, warps, 3 if bk == 128 else 4))
    return out


def buffers(device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(16 << 20, dtype=torch.float32, device=device),
            torch.zeros(1 << 16, dtype=torch.int32, device=device))  # fmt: skip


def compile_only(shapes, batches, part: int, parts: int, sms: int) -> None:
    todo = sorted({(name, cfg) for name in shapes for M in batches for cfg in configs(M, *SHAPES[name], sms)})
    ws, counts = buffers("cuda")
    for i, (name, cfg) in enumerate(todo):
        if i % parts == part:
            N, K = SHAPES[name]
            x = torch.randn(160, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            r = torch.zeros(160, N, device="cuda", dtype=torch.bfloat16)
            try:
                wide_gemm(x, w, r, r, cfg, ws, counts)
            except Exception as exc:
                print(f"  compile failed {name} {cfg}: {type(exc).__name__}", flush=True)
    torch.cuda.synchronize()


def main(shapes, batches, jobs: int) -> None:
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if jobs > 1:
        compile_in_jobs(__file__, shapes, batches, jobs)
    ws, counts = buffers("cuda")
    summary = []
    for name in shapes:
        N, K = SHAPES[name]
        copies = max(1, min(CALLS, ROTATE_BYTES // (N * K * 2)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        print(f"== {name}: N={N} K={K} + residual, {copies} weight copies, us per call")
        for M in batches:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            hidden = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            base = graph_us([lambda i=i: hidden.addmm_(x, weights[i % len(weights)].T) for i in range(CALLS)])
            results = []
            for cfg in configs(M, N, K, sms):
                try:
                    y = torch.empty_like(hidden)
                    wide_gemm(x, weights[0], hidden, y, cfg, ws, counts)
                    ref = torch.addmm(hidden, x, weights[0].T)
                    bad = (y.float() - ref.float()).abs().max().item()
                    assert bad <= 0.05 * ref.abs().max().item(), f"max error {bad}"
                    us = graph_us([lambda i=i, cfg=cfg: wide_gemm(x, weights[i % len(weights)], hidden, hidden, cfg,
                                                                  ws, counts) for i in range(CALLS)])  # fmt: skip
                except Exception as exc:
                    print(f"  skip M={M} [{cfg}]: {type(exc).__name__}: {(str(exc) or ' ').splitlines()[0][:90]}")
                    continue
                results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            print(f"{name:>5} M={M:>4} cuBLAS {base:6.2f} | best " +
                  " | ".join(f"{us:6.2f} [{cfg}]" for us, cfg in results[:4]), flush=True)  # fmt: skip
            for kind in ("swap", "mn"):
                for mode in ("inline", "sumk"):
                    sub = [r for r in results if r[1].swap == (kind == "swap") and r[1].inline == (mode == "inline")]
                    if sub:
                        print(f"      best {kind:>4} {mode:>6}: {sub[0][0]:6.2f} [{sub[0][1]}]")
            if results:
                summary.append((name, M, base, results[0][0], results[0][1]))
    print("== summary: shape, rows, cuBLAS us, best wide us, launch")
    for name, M, base, best, cfg in summary:
        print(f"{name:>5} {M:>4} {base:6.2f} {best:6.2f} x{base / best:.2f} [{cfg}]")


def self_check() -> None:
    torch.manual_seed(0)
    N, K = 64, 256
    ws, counts = buffers("cpu")
    for M, swap, inline, split in itertools.product((3, 40), (False, True), (True, False), (1, 2)):
        if split == 1 and not inline:
            continue
        x, w, r = torch.randn(M, K), torch.randn(N, K) / K**0.5, torch.randn(M, N)
        out = torch.empty(M, N)
        wide_gemm(x, w, r, out, Wide(32, 32, 64, split, swap, inline, 4, 2), ws, counts)
        torch.testing.assert_close(out, torch.addmm(r, x, w.T), rtol=1e-4, atol=1e-4)
    print("cpu self-check passed")


if __name__ == "__main__":
    run_split_k_sweep(__doc__, list(SHAPES), BATCHES, self_check, compile_only, main)
