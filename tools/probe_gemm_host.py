"""Host time of a cuBLAS GEMM launch for a row count seen before vs a new one (CUDA only).

    python tools/probe_gemm_host.py

Eager prefill steps run Qwen3-0.6B's projections and the LM head at a row count that changes
every step. This times the host side of `F.linear` (no synchronisation: the launch alone) for
row counts never used before and for the same counts again, for each of the model's GEMM shapes.

Research tool, not product code. Findings: docs/performance.md, section "Padded eager steps".
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}  # fmt: skip


def host_us(x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    F.linear(x, w)
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    F.linear(torch.randn(8, 1024, device=dev, dtype=torch.bfloat16), torch.randn(64, 1024, device=dev, dtype=torch.bfloat16))
    torch.cuda.synchronize()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        rows = [97, 131, 173, 211] if name == "lm_head" else [16391, 16423, 16457, 16499]
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in rows}
        torch.cuda.synchronize()
        first = [host_us(xs[m], w) for m in rows]
        torch.cuda.synchronize()
        again = [host_us(xs[m], w) for m in rows]
        torch.cuda.synchronize()
        print(f"{name:8} rows {rows}: new shape {', '.join(f'{t:8.0f}' for t in first)} us;"
              f" same shape again {', '.join(f'{t:6.0f}' for t in again)} us")


if __name__ == "__main__":
    main()
