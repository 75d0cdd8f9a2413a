"""One-token matmul bandwidth on CPU: `F.linear` (oneDNN/MKL) vs the compiled GEMV of
`minisgl/kernels/cpu_gemv.py`, over 30 layers of SmolLM2-135M's weight shapes (too big for the
caches, as in a real decode step). `python scripts/cpu_gemv_bench.py`"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_gemv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
for dtype in (torch.bfloat16, torch.float32):
    weights = [torch.randn(n, k).to(dtype) for _ in range(30) for n, k in SHAPES]
    xs = {k: torch.randn(1, k).to(dtype) for k in (576, 1536)}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    for name, fn in (("F.linear", F.linear), ("cpu_gemv", cpu_gemv.linear)):
        def run() -> None:
            for w in weights:
                fn(xs[w.shape[1]], w)

        run()
        start = time.perf_counter()
        for _ in range(5):
            run()
        seconds = (time.perf_counter() - start) / 5
        print(f"{str(dtype):15} {name:9} {seconds * 1e3:7.1f} ms per pass over {nbytes / 1e6:.0f} MB: {nbytes / seconds / 1e9:5.1f} GB/s")
    w = weights[2]
    x = xs[576]
    err = (cpu_gemv.linear(x, w).float() - F.linear(x.float(), w.float())).abs().max().item()
    print(f"{str(dtype):15} max |gemv - fp32 reference| = {err:.3g}")
