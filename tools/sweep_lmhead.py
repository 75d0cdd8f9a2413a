"""The LM head with sampling in its epilogue, against cuBLAS's LM head + the sampling kernel.

A decode step computes logits = x @ W.T ([rows, 151,936] bf16: 47 MB written at ~155 rows), then
`kernels/sampling.py` reads them back for the Gumbel-max draw. Here one Triton GEMM computes each
[rows, BLOCK_N] logits tile, rounds it to bf16 as the unfused path does, adds the same Gumbel noise
(same hash of seed, row and token) and keeps each row's best token of the tile; a small kernel then
picks each row's best tile. The logits never reach HBM.

GPU: `python tools/sweep_lmhead.py` prints us per call (CUDA graph, median) for cuBLAS F.linear,
the sampling kernel, their sum, and the fused launches, and checks that the fused draw equals the
unfused one on the same logits where the logits agree. Without CUDA: a self-check under the Triton
interpreter on a tiny vocabulary.

Research tool, not product code. Findings: docs/performance.md, "Tried and lost" (the LM head with
the Gumbel-max draw in its epilogue).
"""

from __future__ import annotations

import itertools

import torch

if not torch.cuda.is_available():
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()  # before triton is imported

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from sweep_gemm import graph_us  # noqa: E402  (same directory)
from triton.language.extra.cuda import libdevice  # noqa: E402

from minisgl.kernels.sampling import _pick_split_kernel, gumbel_sample, hash_uniform  # noqa: E402

VOCAB, HIDDEN = 151_936, 1024


@triton.jit(do_not_specialize=["M", "seed"])
def _lm_head_sample_kernel(x_ptr, w_ptr, temp_ptr, val_ptr, idx_ptr, M, N, seed, num_tiles, K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           FAST_LOG: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # swapped: W's rows are the MMA's M side
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # [n, m], rounded as the unfused path
    temperature = tl.load(temp_ptr + offs_m, mask=m_mask, other=0.0)
    inv_t = 1.4426950408889634 / tl.maximum(temperature, 1e-20)
    row_key = seed.to(tl.uint32) + offs_m.to(tl.uint32) * 0x85EBCA77
    # The sampling kernel's noise, per (token, row).
    u = hash_uniform(offs_n.to(tl.uint32)[:, None] * 0x9E3779B1 + row_key[None, :])
    if FAST_LOG:
        gumbel = libdevice.fast_log2f(-libdevice.fast_log2f(u))
    else:
        gumbel = tl.log2(-tl.log2(u))
    score = tl.where((temperature > 0)[None, :], logits * inv_t[None, :] - gumbel, logits)
    score = tl.where(n_mask[:, None], score, float("-inf"))
    top = tl.max(score, axis=0)  # [m]
    first = tl.min(tl.where(score == top[None, :], offs_n[:, None], 2147483647), axis=0)
    tl.store(val_ptr + offs_m * num_tiles + pid_n, top, mask=m_mask)
    tl.store(idx_ptr + offs_m * num_tiles + pid_n, first, mask=m_mask)


def lm_head_sample(x, w, temperature, seed, block_m, block_n, block_k, warps, stages, vals, idxs, tokens) -> None:
    M, K = x.shape
    N = w.shape[0]
    num_tiles = triton.cdiv(N, block_n)
    _lm_head_sample_kernel[(num_tiles,)](x, w, temperature, vals, idxs, M, N, seed, num_tiles, K=K, BLOCK_M=block_m,
                                         BLOCK_N=block_n, BLOCK_K=block_k, FAST_LOG=x.is_cuda, num_warps=warps,
                                         num_stages=stages)  # fmt: skip
    _pick_split_kernel[(M,)](vals, idxs, tokens, num_tiles, SPLITS=triton.next_power_of_2(num_tiles), num_warps=4,
                             PDL=False)  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    w = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16) / HIDDEN**0.5
    vals = torch.empty(256 * 4096, device=dev)
    idxs = torch.empty(256 * 4096, device=dev, dtype=torch.int32)
    for rows in (160, 256, 64):
        x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
        temperature = torch.full((rows,), 0.6, device=dev)
        tokens = torch.empty(rows, device=dev, dtype=torch.int64)
        gemm = graph_us([lambda: F.linear(x, w)] * 5)
        logits = F.linear(x, w)
        sample = graph_us([lambda: gumbel_sample(logits, temperature, 7)] * 5)
        both = graph_us([lambda: gumbel_sample(F.linear(x, w), temperature, 7)] * 5)
        print(f"rows {rows}: cuBLAS {gemm:.1f} + sampling {sample:.1f} us; together {both:.1f} us", flush=True)
        bm = max(16, triton.next_power_of_2(rows))
        results = []
        for bn, bk, warps, stages in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4)):
            if bn * bm > 128 * 256 or (bk == 128 and stages > 3):
                continue
            try:
                lm_head_sample(x, w, temperature, 7, bm, bn, bk, warps, stages, vals, idxs, tokens)
                us = graph_us([lambda: lm_head_sample(x, w, temperature, 7, bm, bn, bk, warps, stages, vals, idxs,
                                                      tokens)] * 5)  # fmt: skip
            except Exception as exc:
                print(f"  skip {bm}x{bn}x{bk} w{warps} s{stages}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            results.append((us, f"{bm}x{bn}x{bk} w{warps} s{stages}"))
        for us, name in sorted(results)[:5]:
            print(f"   fused {name}: {us:.1f} us")
        # Same draw where the logits agree: greedy rows compare against argmax of cuBLAS logits.
        lm_head_sample(x, w, torch.zeros_like(temperature), 7, bm, 128, 64, 8, 3, vals, idxs, tokens)
        agree = (tokens == logits.float().argmax(1)).float().mean().item()
        print(f"   greedy agreement with cuBLAS argmax: {agree:.3f}", flush=True)


def self_check() -> None:
    torch.manual_seed(0)
    rows, vocab, hidden = 5, 300, 64
    x = torch.randn(rows, hidden)
    w = torch.randn(vocab, hidden) / hidden**0.5
    temperature = torch.tensor([0.0, 0.7, 0.0, 1.0, 0.5])
    vals, idxs = torch.empty(rows * 64), torch.empty(rows * 64, dtype=torch.int32)
    tokens = torch.empty(rows, dtype=torch.int64)
    lm_head_sample(x, w, temperature, 11, 16, 32, 32, 4, 1, vals, idxs, tokens)
    ref = gumbel_sample(x @ w.T, temperature, 11)
    assert tokens.tolist() == ref.tolist(), (tokens, ref)
    print("cpu self-check passed")


if __name__ == "__main__":
    main() if torch.cuda.is_available() else self_check()
