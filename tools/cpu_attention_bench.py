"""CPU kernel microbenchmark: `python tools/cpu_attention_bench.py [--threads N] [--runs N]`.

Decode attention (SmolLM2's heads: 3 KV heads x 3 q heads, head_dim 64; 32 requests of 128-640
tokens on 16-token pages scattered over a 64k-slot pool) and the per-token ops at SmolLM2's
shapes (hidden 576, intermediate 1536, 9 + 3 heads), in bf16 and fp32, on every code path of the
C++ CPU kernels this CPU runs (avx512bf16, avx512, avx2, portable: kernels/cpp_ext.py) next to the torch
path. fp32 also times decode attention over fp16 and bf16 pages (fp32 q and math: the GGUF default's
16-bit KV, kvcache/pool.py). Prints us per call (the best of several timed batches: the CI machine is shared and noisy)
and, for attention, the K/V bytes read per second. `--old REV` adds the AVX-512-only torch
extensions of git revision REV (before/after); `--threads 1 --clock cpu` is the robust setting on
a busy machine.

Research tool, not product code. Findings: docs/performance.md, section "C++ decode attention on
CPU".
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl.kernels import cpp_ext
from minisgl.kernels.activation_ref import silu_and_mul_ref
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from minisgl.kernels.rotary_ref import rotary_ref

BATCH, KV_HEADS, GROUP, HEAD_DIM, SLOTS, PAGE = 32, 3, 3, 64, 65536, 16
HIDDEN, INTER = 576, 1536


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def best_us(fn: Callable[[], object], runs: int, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = _clock()
        for _ in range(runs):
            fn()
        best = min(best, (_clock() - start) / runs)
    return best * 1e6


def load_old(rev: str) -> tuple[object, object]:
    """The AVX-512-only torch extensions this library replaced, built from git revision `rev`
    (e.g. d1240af, before the change) with their own flags (-march=native), cached in /tmp."""
    import subprocess
    import tempfile
    from pathlib import Path

    from torch.utils.cpp_extension import load_inline

    def source(*names: str) -> str:
        return "".join(subprocess.run(["git", "show", f"{rev}:minisgl/kernels/csrc/{n}"], capture_output=True,
                                      text=True, check=True).stdout for n in names)  # fmt: skip

    folder = Path(tempfile.gettempdir()) / f"minisgl_old_cpu_kernels_{rev}"
    built = []
    for name, files, functions, flags in (
        ("minisgl_cpu_ops", ("avx512_math.h", "cpu_ops.cpp"),
         ["gemv", "gemm_rows", "has_bf16_dot", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul"], []),
        ("minisgl_cpu_decode_attention", ("avx512_math.h", "cpu_decode_attention.cpp"), ["decode_attention"],
         ["-ffast-math", "-fno-finite-math-only"]),
    ):  # fmt: skip
        (folder / name).mkdir(parents=True, exist_ok=True)
        built.append(load_inline(name=name, cpp_sources=[source(*files)], functions=functions,
                                 extra_cflags=["-O3", "-march=native", *flags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                                 build_directory=str(folder / name), verbose=False))  # fmt: skip
    return built[0], built[1]


def attention_case(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> tuple:
    """q of `dtype` over pages of `kv_dtype` (default: `dtype`)."""
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(128, 640) for _ in range(BATCH)]
    k = torch.randn(SLOTS, KV_HEADS, HEAD_DIM).to(kv_dtype or dtype)
    v = torch.randn(SLOTS, KV_HEADS, HEAD_DIM).to(kv_dtype or dtype)
    table = torch.zeros(BATCH, 1024, dtype=torch.int32)
    pages, used = torch.randperm(SLOTS // PAGE), 0
    for i, n in enumerate(lens):
        count = -(-n // PAGE)
        slots = (pages[used : used + count, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]
        used += count
        table[i, :n] = slots.int()
    q = torch.randn(BATCH, KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    return q, k, v, table, torch.arange(BATCH), torch.tensor(lens, dtype=torch.int32)


def torch_attention(q, k, v, table, rows, seq_lens, scale):  # type: ignore[no-untyped-def]
    """The torch backend's CPU path: per request, gather its K/V and one SDPA call."""
    outs = []
    for i in range(q.shape[0]):
        slots = table[rows[i], : int(seq_lens[i])].long()
        ki = k.index_select(0, slots).to(q.dtype).transpose(0, 1)
        vi = v.index_select(0, slots).to(q.dtype).transpose(0, 1)
        qi = q[i].view(KV_HEADS, GROUP, HEAD_DIM)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, scale=scale).reshape(-1, HEAD_DIM))
    return torch.stack(outs)


def cases(lib: cpp_ext.CpuKernels, dtype: torch.dtype, old: tuple | None) -> dict[str, tuple]:
    """name -> (torch call, isa -> C++ call, runs per batch, the replaced kernel's call or None)."""
    ops, attn = old if old is not None and dtype == torch.bfloat16 else (None, None)
    torch.manual_seed(1)
    x1, xb = torch.randn(1, HIDDEN).to(dtype), torch.randn(32, HIDDEN).to(dtype)
    r1, rb = torch.randn(1, HIDDEN).to(dtype), torch.randn(32, HIDDEN).to(dtype)
    w = torch.randn(HIDDEN).to(dtype)
    g1, gb = torch.randn(1, 2 * INTER).to(dtype), torch.randn(32, 2 * INTER).to(dtype)
    qkv = torch.randn(1, (9 + 6) * HEAD_DIM).to(dtype)
    q, k = qkv[:, : 9 * HEAD_DIM].view(1, 9, HEAD_DIM), qkv[:, 9 * HEAD_DIM : 12 * HEAD_DIM].view(1, 3, HEAD_DIM)
    angles = torch.randn(2048, HEAD_DIM // 2)
    cos, sin, pos = angles.cos(), angles.sin(), torch.tensor([77])
    weight = torch.randn(INTER, HIDDEN).to(dtype)
    att = attention_case(dtype)
    scale = HEAD_DIM**-0.5
    narrow = {}  # fp32 q over 16-bit pages
    for kv_name, kv_dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)) if dtype == torch.float32 else ():
        case = attention_case(dtype, kv_dtype)
        narrow[f"decode attention 32 reqs, {kv_name} pages"] = (
            lambda c=case: torch_attention(*c, scale), lambda i, c=case: lambda: lib.decode_attention(*c, scale, i),
            10, None)  # fmt: skip
    return {
        "rms_norm [1, 576]": (lambda: rms_norm_ref(x1, w, 1e-5), lambda i: lambda: lib.rms_norm(x1, w, 1e-5, i), 2000,
                              ops and (lambda: ops.rms_norm(x1, w, 1e-5))),
        "rms_norm [32, 576]": (lambda: rms_norm_ref(xb, w, 1e-5), lambda i: lambda: lib.rms_norm(xb, w, 1e-5, i), 500,
                               ops and (lambda: ops.rms_norm(xb, w, 1e-5))),
        "add_rms_norm [1, 576]": (lambda: fused_add_rms_norm_ref(x1, r1, w, 1e-5),
                                  lambda i: lambda: lib.add_rms_norm(x1, r1, w, 1e-5, i), 2000,
                                  ops and (lambda: ops.add_rms_norm(x1, r1, w, 1e-5))),
        "add_rms_norm [32, 576]": (lambda: fused_add_rms_norm_ref(xb, rb, w, 1e-5),
                                   lambda i: lambda: lib.add_rms_norm(xb, rb, w, 1e-5, i), 500,
                                   ops and (lambda: ops.add_rms_norm(xb, rb, w, 1e-5))),
        "silu_and_mul [1, 3072]": (lambda: silu_and_mul_ref(g1), lambda i: lambda: lib.silu_and_mul(g1, i), 2000,
                                   ops and (lambda: ops.silu_and_mul(g1))),
        "silu_and_mul [32, 3072]": (lambda: silu_and_mul_ref(gb), lambda i: lambda: lib.silu_and_mul(gb, i), 200,
                                    ops and (lambda: ops.silu_and_mul(gb))),
        "rotary [1, 9+3, 64]": (lambda: rotary_ref(pos, q, k, cos, sin),
                                lambda i: lambda: lib.rotary(pos, q, k, cos, sin, isa=i), 2000,
                                ops and (lambda: ops.rotary(pos, q, k, cos, sin, None, None, 0.0, 0.0))),
        "gemv [1, 576] x [1536, 576]": (lambda: F.linear(x1, weight), lambda i: lambda: lib.gemv(x1, weight, None, i), 300,
                                        ops and (lambda: ops.gemv(x1, weight, None))),
        "decode attention 32 reqs": (lambda: torch_attention(*att, scale),
                                     lambda i: lambda: lib.decode_attention(*att, scale, i), 10,
                                     attn and (lambda: attn.decode_attention(*att, scale))),
        **narrow,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch / kernel threads (0: torch's default)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the runs per batch (shorter: < 1)")
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--clock", choices=list(CLOCK), default="wall",
                        help="cpu: process CPU time (robust on a shared machine with --threads 1)")
    parser.add_argument("--old", metavar="REV", help="also time the replaced AVX-512-only torch extensions, built from git revision REV")
    args = parser.parse_args()
    global _clock
    _clock = CLOCK[args.clock]
    old = load_old(args.old) if args.old else None
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = cpp_ext.load_library()
    paths = list(reversed(lib.supported))
    print(f"threads {torch.get_num_threads()}; paths this CPU runs: {', '.join(paths)} (auto: {lib.best_isa()}); "
          f"AVX512-BF16 dot products for bf16 GEMV/attention: {'yes' if lib.has_bf16_dot('auto') else 'no'}")  # fmt: skip
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[args.dtype]
    for dtype in dtypes:
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        extra = "       old" if old is not None and dtype == torch.bfloat16 else ""
        print(f"\n{name}, us per call ({args.clock} clock, best of 5 batches)")
        print(f"{'':>6}{'op':<40}" + "".join(f"{p:>10}" for p in paths) + f"{'torch':>10}{extra}")
        attention: dict[str, list[float]] = {}
        for op, (ref, make, runs, before) in cases(lib, dtype, old).items():
            n = max(1, int(runs * args.scale))
            times = [best_us(make(p), n) for p in paths] + [best_us(ref, max(1, n // 4))]
            after = [best_us(before, n)] if before else []
            print(f"{name:>4}  {op:<40}" + "".join(f"{t:>10.1f}" for t in times + after))
            if op.startswith("decode attention"):
                attention[op] = times
        seq_lens = attention_case(dtype)[-1]
        for op, times in attention.items():
            itemsize = 2 if op.endswith("pages") else dtype.itemsize
            kv_bytes = 2 * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * itemsize
            rates = ", ".join(f"{p} {kv_bytes / t / 1e3:.1f}" for p, t in zip([*paths, "torch"], times))
            print(f"{name:>4}  {op} reads {kv_bytes / 1e6:.1f} MB of K/V per call: GB/s {rates}")


if __name__ == "__main__":
    main()
