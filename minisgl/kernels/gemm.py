"""Skinny GEMM for decode: `out = x @ W.T (+ residual)`, x [M, K] with M <= a few hundred rows.

At decode batch sizes the projections of a small model are short kernels: on an H200 cuBLAS
spends 6-7 us on o_proj or down_proj of Qwen3-0.6B at up to 64 rows (N = 1024, K = 2048 / 3072:
4-6 MB of weights, 1-1.5 us of HBM time), as N = 1024 gives it few output tiles.

Here the K dimension is cut into `SPLIT_K` slices, so that the weight stream is spread over every
SM. Each program writes its fp32 partial tile to a workspace and bumps a per-tile counter; the
last program of a tile (the counter says which) sums the partials in split order (fixed, so the
result is deterministic), adds the residual and writes the output. One launch, and the residual
add happens in fp32 before the single rounding, as cuBLAS's beta = 1 does.

The per-tile counters are the device's arrival counters (`kernels/arrival.py`): zero between
launches, one buffer for every call on the engine's stream. The fp32 partials live in one
workspace per device, likewise.

Measured on an H200 it beats cuBLAS only up to 64 rows (`TUNED`, kernels/tuned/splitk_gemm.json:
where cuBLAS's tiles leave most SMs idle); from there cuBLAS wins, so the engine takes this kernel
only where the table says it pays (`pays`). The reference (and the CPU path) is `torch.addmm`.
Off: --no-triton-gemm.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.arrival import NUM_COUNTERS, arrival_counters
from minisgl.kernels.impl import num_sms
from minisgl.kernels.pdl import pdl_args
from minisgl.kernels.tuning import device_name, load_table

MAX_ROWS = 256  # above this, cuBLAS (the kernel is tuned for decode batches)
_WORKSPACE_FLOATS = 8 << 20  # 32 MB of fp32 partials


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} split{self.split_k} w{self.num_warps} st{self.num_stages}"


# M changes from call to call (one compiled variant per config, not per M).
@triton.jit(do_not_specialize=["M"])
def _splitk_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    res_ptr,
    part_ptr,
    count_ptr,
    M,
    stride_xm,
    stride_om,
    stride_rm,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * (K // SPLIT_K) + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K // SPLIT_K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    done = True
    if SPLIT_K > 1:
        # Partial tiles live at [split, tile] in the workspace, BLOCK_M x BLOCK_N floats each.
        tile = pid_m * (N // BLOCK_N) + pid_n
        num_tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
        tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + (pid_k * num_tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs, acc)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        # acq_rel: releases this program's partial; the last arrival acquires all the others.
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        done = arrived == SPLIT_K - 1
        if done:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order: the sum does not depend on arrival order
                ptrs = part_ptr + (s * num_tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs
                acc += tl.load(ptrs, cache_modifier=".cg")  # from L2: written by other SMs
            tl.store(count_ptr + tile, 0)  # ready for the next call
    if done:
        mask = m_mask[:, None] & (offs_n[None, :] < N)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
            acc += res.to(tl.float32)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _partials(device: torch.device) -> torch.Tensor:
    """fp32 partial tiles for every split-K call on `device` (one stream: see the docstring)."""
    return torch.empty(_WORKSPACE_FLOATS, dtype=torch.float32, device=device)


def _tuned() -> dict[tuple[str, int, int], list[tuple[int, GemmConfig]]]:
    """kernels/tuned/splitk_gemm.json: (device name, N, K) -> [(largest M served, launch)], in
    increasing M (the file's order: the first that serves M is taken)."""
    tables: dict[tuple[str, int, int], list[tuple[int, GemmConfig]]] = {}
    for table in load_table("splitk_gemm")["tables"]:
        launches = [
            (e["max_rows"], GemmConfig(e["block_m"], e["block_n"], e["block_k"], e["split_k"], e["num_warps"],
                                       e["num_stages"]))
            for e in table["launches"]
        ]
        tables[(table["device"], table["n"], table["k"])] = launches
    return tables


# Launches measured where they beat cuBLAS's in-place addmm_ (Qwen3-0.6B's o_proj and down_proj on
# an H200, up to 64 rows); larger batches, and devices and shapes not listed, keep cuBLAS.
TUNED = _tuned()


def tuned_config(M: int, N: int, K: int, device: torch.device) -> GemmConfig | None:
    """The measured launch for this shape on `device`, or None where cuBLAS is as fast or faster."""
    for max_rows, cfg in TUNED.get((device_name(device), N, K), []):
        if M <= max_rows:
            return cfg
    return None


def default_config(M: int, N: int, K: int, device: torch.device) -> GemmConfig:
    """A launch for any decode-sized shape (tests, sweeps): rows in one or two M tiles, then as
    many K splits as it takes to give every SM a program (each split keeping two K blocks)."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64 if N % 64 == 0 else 32
    block_k = 128 if K % 256 == 0 else 64
    tiles = triton.cdiv(M, block_m) * (N // block_n)
    split = 1
    while tiles * split * 2 <= num_sms(device) and K % (block_k * split * 4) == 0:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split, 4, 3)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes the kernel takes: a 2-D row-major x of at most `MAX_ROWS` rows, W [N, K] contiguous,
    N a multiple of 32 and K of 64."""
    N, K = weight.shape
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.is_contiguous()
        and N % 32 == 0
        and K % 64 == 0
        and x.dtype == weight.dtype
    )


def pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel beats cuBLAS here, by the measured table (`TUNED`)."""
    return supports(x, weight) and tuned_config(x.shape[0], weight.shape[0], weight.shape[1], x.device) is not None


def splitk_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ weight [N, K].T, plus `residual` [M, N] when given (`out` may be
    `residual` itself: the in-place residual add). `config` overrides the tuned launch (sweeps)."""
    assert supports(x, weight), f"unsupported shapes {tuple(x.shape)} @ {tuple(weight.shape)}.T"
    (M, K), N = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    assert residual is None or (residual.shape == (M, N) and residual.stride(1) == 1)
    cfg = config or tuned_config(M, N, K, x.device) or default_config(M, N, K, x.device)
    assert N % cfg.block_n == 0 and K % (cfg.block_k * cfg.split_k) == 0, f"N={N}, K={K} do not divide for {cfg}"
    parts, counts = _partials(x.device), arrival_counters(x.device)
    grid = (N // cfg.block_n, triton.cdiv(M, cfg.block_m), cfg.split_k)
    assert cfg.split_k == 1 or (grid[0] * grid[1] <= NUM_COUNTERS and grid[0] * grid[1] * grid[2] * cfg.block_m *
                                cfg.block_n <= parts.numel()), f"workspace too small for M={M} {cfg}"  # fmt: skip
    res = residual if residual is not None else out
    _splitk_gemm_kernel[grid](
        x, weight, out, res, parts, counts, M, x.stride(0), out.stride(0), res.stride(0),
        N=N, K=K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        HAS_RESIDUAL=residual is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device),
    )  # fmt: skip
    return out


__all__ = ["MAX_ROWS", "TUNED", "GemmConfig", "default_config", "pays", "splitk_gemm", "supports", "tuned_config"]
