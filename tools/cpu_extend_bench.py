"""Per-layer time of the C++ extend attention (kernels/cpu_extend.py) against the torch backend's
per-request path (`TorchAttnBackend._extend`: gather, repeat for GQA, SDPA with the prefix mask),
in one process on the same pool and batch, at W2-like shapes: SmolLM2-135M's attention (9 q
heads, 3 KV heads, head_dim 64), requests of 64-512 new tokens, a third of them over a cached
prefix. Reports wall and process CPU time per layer (the kernel's pool threads included) and the
load average (the machine may be shared).

    PYTHONPATH=$PWD python tools/cpu_extend_bench.py [--isa avx2] [--dtype float32] [--reps 5]

`--dtype float16`: fp16 pages under fp32 activations (the default GGUF server's KV cache).

Findings: docs/performance.md, "C++ prefill attention on CPU (fifteenth session, h-cpuext)".
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import get_args

import torch

from minisgl.attention.batch import ForwardBatch
from minisgl.attention.torch_backend import _PLAIN, TorchAttnBackend
from minisgl.kernels import cpu_attention
from minisgl.kvcache.pool import KVPool
from minisgl.platform import current
from minisgl.platform.kernel_config import CpuIsa, KernelConfig

HQ, HKV, D, PAGE = 9, 3, 64, 16


def make_batch(requests: list[tuple[int, int]], dtype: torch.dtype) -> tuple[KVPool, ForwardBatch]:
    """A pool holding every request's prefix and new tokens on shuffled pages, and the extend batch."""
    pages_per = [-(-(p + e) // PAGE) for p, e in requests]
    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    pool = KVPool(1, sum(pages_per) + 8, PAGE, HKV, D, dtype, torch.device("cpu"), compute)
    pool.k[0].copy_(torch.randn(pool.k[0].shape))
    pool.v[0].copy_(torch.randn(pool.v[0].shape))
    pages = torch.randperm(pool.num_pages)
    width = max(pages_per) * PAGE
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    pos = torch.arange(width)
    used = 0
    for row, n in enumerate(pages_per):
        mine = pages[used : used + n]
        used += n
        table[row, : n * PAGE] = (mine[pos[: n * PAGE] // PAGE] * PAGE + pos[: n * PAGE] % PAGE).int()
    seq = [p + e for p, e in requests]
    ext = [e for _, e in requests]
    out_loc = torch.cat([table[r, s - e : s] for r, (s, e) in enumerate(zip(seq, ext))]).long()

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32)

    batch = ForwardBatch(
        phase="extend", input_ids=torch.zeros(len(out_loc), dtype=torch.int64),
        positions=torch.cat([torch.arange(s - e, s) for s, e in zip(seq, ext)]), out_loc=out_loc,
        rows=torch.arange(len(requests)), seq_lens=i32(seq), extend_lens=i32(ext),
        extend_starts=i32([sum(ext[:i]) for i in range(len(ext))]), token_table=table, seq_lens_cpu=seq,
        extend_lens_cpu=ext, sample_idx=torch.zeros(1, dtype=torch.int64),
    )  # fmt: skip
    return pool, batch


def time_layer(backend: TorchAttnBackend, batch: ForwardBatch, q, k, v, reps: int) -> tuple[float, float, torch.Tensor]:
    """(wall ms, process CPU ms) per layer's attention, best of `reps`, and the output. The K/V
    store (`KVPool.store`, the same in both paths) runs once before: on a loaded machine its
    OpenMP index_copy_ alone can take tens of ms, waiting for a descheduled thread."""
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch)  # stores this step's K/V, warms up
    pool, plans = backend.pool, batch.attn_meta.plans[None]

    def attend() -> torch.Tensor:
        if backend.cpu_extend:
            return backend._extend_kernel(q, pool.k[0], pool.v[0], batch)
        return backend._extend(q, pool.k[0], pool.v[0], plans, _PLAIN, backend.sm_scale)

    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        out = attend()
        best_wall = min(best_wall, (time.perf_counter() - w0) * 1e3)
        best_cpu = min(best_cpu, (time.process_time() - c0) * 1e3)
    batch.attn_meta = None
    return best_wall, best_cpu, out


def run(name: str, requests: list[tuple[int, int]], dtype: torch.dtype, reps: int) -> None:
    pool, batch = make_batch(requests, dtype)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(batch.num_tokens, HQ, D).to(q_dtype)
    k, v = (torch.randn(batch.num_tokens, HKV, D).to(q_dtype) for _ in range(2))
    res = {}
    for use_kernel in (False, True):
        backend = TorchAttnBackend(pool, HQ, HKV, D, D**-0.5)
        backend.cpu_extend = use_kernel
        res[use_kernel] = time_layer(backend, batch, q, k, v, reps)
    diff = (res[True][2].float() - res[False][2].float()).abs().max().item()
    (tw, tc, _), (kw, kc, _) = res[False], res[True]
    print(f"{name:34s} T={batch.num_tokens:5d}  torch {tw:8.2f} ms wall {tc:8.2f} ms cpu | kernel {kw:7.2f} ms wall "
          f"{kc:7.2f} ms cpu | {tw / kw:5.1f}x wall  max|diff| {diff:.2e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isa", default="auto", choices=list(get_args(CpuIsa)), help="as --cpu-isa")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the pages'")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # fp32 pools take the kernels under the GGUF default's config (cpu_kernels_fp32)
    current().use_kernels(KernelConfig(cpu_kernels_fp32=True, cpu_isa=args.isa))
    lib = cpu_attention.load()
    assert lib is not None, "the C++ CPU kernels did not build"
    print(f"isa {lib.resolve()}, pool {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"load average before {os.getloadavg()}")  # fmt: skip
    rng = random.Random(0)
    w2 = [(rng.choice([0, 0, rng.randint(16, 256)]), rng.randint(64, 512)) for _ in range(32)]
    run("one request, 300 new", [(0, 300)], dtype, args.reps)
    run("one request, 200 over 100 cached", [(100, 200)], dtype, args.reps)
    run("W2-like: 32 x 64-512, 1/3 cached", w2, dtype, args.reps)
    run("W2-like chunk: 8 requests", w2[:8], dtype, args.reps)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
