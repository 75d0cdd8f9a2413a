"""Launch sweep of the fused sampling kernel (`kernels/sampling.py`) on the offline workload's
shape: R rows of Qwen3's 151,936-entry vocabulary, bf16 logits, temperature 0.6.
`python tools/sweep_sampling.py` prints us per call (CUDA-graph replayed) for the default and
the swept (split, block, warps), and the default with libdevice's exact log2 instead of the
hardware's approximate one.

Research tool, not product code. Findings: docs/performance.md, section "Sampling kernel".
"""

from __future__ import annotations

import itertools

import torch
from sweep_decode_attention import bench  # same directory: the graph-replayed timing, us per call

from minisgl.kernels.sampling import gumbel_sample

VOCAB = 151_936


def main() -> None:
    dev = torch.device("cuda")
    print(f"{'rows':>5} {'split':>6} {'block':>6} {'warps':>5} {'us':>8} {'GB/s':>7}")
    for rows in (256, 170, 64, 16):
        logits = torch.randn(rows, VOCAB, device=dev).bfloat16()
        temperature = torch.full((rows,), 0.6, device=dev)
        exact = bench(lambda: gumbel_sample(logits, temperature, 7, fast_log=False))
        print(f"{rows:>5} {8192:>6} {1024:>6} {4:>5} {exact:>8.1f} {logits.numel() * 2 / exact / 1e3:>7.0f} exact log2")
        results = []
        for split, block, warps in itertools.product((4096, 8192, 16384, 32768), (512, 1024, 2048, 4096), (4, 8)):
            if block > split:
                continue
            us = bench(lambda: gumbel_sample(logits, temperature, 7, split=split, block=block, num_warps=warps))
            results.append((us, split, block, warps))
        default = next(r for r in results if r[1:] == (8192, 1024, 4))
        for tag, (us, split, block, warps) in [("default", default)] + [("", r) for r in sorted(results)[:3]]:
            print(f"{rows:>5} {split:>6} {block:>6} {warps:>5} {us:>8.1f} {logits.numel() * 2 / us / 1e3:>7.0f} {tag}")


if __name__ == "__main__":
    main()
