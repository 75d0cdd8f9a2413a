"""Does programmatic dependent launch (PDL) shorten the gaps between kernels in a CUDA graph?

    python tools/probe_pdl.py        (CUDA only)

A decode step replays ~300 small kernels; on an H200 each kernel boundary costs a launch gap.
With PDL (`launch_pdl=True`, Hopper and later) the next kernel is launched while the previous
one drains and waits in `gdc_wait` for its results. This captures chains of dependent small
Triton kernels (and cuBLAS GEMMs between them, as in a decoder layer) with and without the
flag, checks the chained result, and prints microseconds per kernel.

Research tool, not product code. Findings: docs/performance.md, section "Programmatic dependent
launch".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def chain(bufs: list[torch.Tensor], length: int, pdl: bool, weight: torch.Tensor | None) -> None:
    n = bufs[0].numel()
    for i in range(length):
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        if weight is not None and i % 3 == 2:
            torch.matmul(src.view(-1, weight.shape[1]), weight.t(), out=dst.view(-1, weight.shape[0]))
            continue
        _add_one_kernel[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024, PDL=pdl, num_warps=4, launch_pdl=pdl)


def timed(rows: int, length: int, pdl: bool, gemm: bool) -> tuple[float, float]:
    bufs = [torch.zeros(rows, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    weight = torch.eye(1024, device="cuda", dtype=torch.bfloat16) if gemm else None
    chain(bufs, length, pdl, weight)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(bufs, length, pdl, weight)
    bufs[0].zero_()
    graph.replay()
    torch.cuda.synchronize()
    adds = length - (length // 3 if gemm else 0)
    result = bufs[length % 2][0, 0].item()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / length)
    expected = float(torch.tensor(float(adds), dtype=torch.bfloat16))
    assert result == expected, f"chain result {result} != {expected}: PDL broke the dependency"
    return sorted(times)[3], result


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(f"{'rows':>5} {'gemm':>5} {'plain us/kernel':>16} {'pdl us/kernel':>14}")
    for rows in (1, 64, 256):
        for gemm in (False, True):
            plain, _ = timed(rows, 240, False, gemm)
            pdl, _ = timed(rows, 240, True, gemm)
            print(f"{rows:>5} {str(gemm):>5} {plain:>16.2f} {pdl:>14.2f}")


if __name__ == "__main__":
    main()
