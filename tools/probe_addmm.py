"""What a residual-adding projection costs inside a CUDA graph, and which kernels it becomes.

The folded-norm layer adds o_proj's and down_proj's output to the residual in the GEMM
(`hidden.addmm_(x, W.T)`). In a captured decode step each such call showed a `memcpy32_post`
kernel (a graph memcpy node, ~1.3 us) before cuBLAS's GEMM. This probe captures 20 calls of each
variant, for both cuBLAS back ends (`torch.backends.cuda.preferred_blas_library`), and prints us
per call (graph replay) and the kernels of one call (torch.profiler over one replay).

GPU only: `python tools/probe_addmm.py`.

Research tool, not product code. Findings: docs/performance.md, section "Folded RMSNorms" (residual
adds through the GEMM's beta).
"""

from __future__ import annotations

import collections

import torch
from sweep_gemm import CALLS, graph_us  # same directory

from minisgl.kernels.gemm import splitk_gemm

SHAPES = {"o": (1024, 2048), "down": (1024, 3072)}


def kernels_per_call(calls) -> str:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return ", ".join(f"{n[:60]} x{c / len(calls):g}" for n, c in names.most_common(4))


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for name, (N, K) in SHAPES.items():
            weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5 for _ in range(CALLS)]
            for M in (16, 64, 160, 256):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                h = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
                variants = {
                    "addmm_": lambda w: h.addmm_(x, w.T),
                    "addmm(out=h)": lambda w: torch.addmm(h, x, w.T, out=h),
                    "mm + add_": lambda w: h.add_(x @ w.T),
                    "mm": lambda w: x @ w.T,
                    "splitk": lambda w: splitk_gemm(x, w, residual=h, out=h),
                }
                for label, fn in variants.items():
                    calls = [lambda i=i, fn=fn: fn(weights[i]) for i in range(CALLS)]
                    us = graph_us(calls)
                    kernels = kernels_per_call(calls)
                    print(f"{backend:>8} {name:>4} M={M:>3} {label:>13} {us:6.2f} us | {kernels}", flush=True)
            del weights


if __name__ == "__main__":
    main()
