"""Long-prefill sweep of the extend attention kernel (issue 28: a 32k-token prompt of Qwen3-0.6B's
shape in <= 0.25 s, 8k in <= 0.035 s), in one GPU call. `python tools/sweep_extend.py [--budget S]`

1. Kernel grid. Qwen3-0.6B's heads (16 q, 8 KV, D 128, bf16), one request per case: a fresh 32k
   prompt in one chunk, the second 16k chunk of a 32k prompt (16k cached), a fresh 8k prompt. Its
   slots are one run of the pool (as the engine hands a fresh prompt its pages) or, for the
   leaders, 16-token pages shuffled over the pool. Every candidate (tile, warps, stages, packed
   q heads; the kernel's bulk path and its key source: the token table, affine reads of the
   run, TMA descriptors) is first compiled in parallel worker processes (Triton's disk cache),
   then checked against the current default launch's output (relative max and mean error) and
   timed with CUDA events (median of REPS calls). Printed per case best first, in ms and TFLOP/s,
   then a ranking by the summed time of the three cases.
2. Whole model (skipped when --budget leaves too little): `bench offline`'s engine for the 0.6B
   shape (dummy weights, no prefix cache, no decode graphs), prefill of one fresh 8k and one 32k
   prompt (one output token; median of 3 wall times) at the current launch, 32k at prefill chunks
   of 8k, 16k and 32k tokens (the scheduler's budget). The tool never swaps the engine's launch at
   run time: to time a leader in the whole model, make it `_extend_config`'s default and rerun.
   (The fifteenth session's run did swap it and timed the leaders so; that is how 256x64 was chosen.)

The last lines name the `_extend_config` long-sequence launch to make the default. Without CUDA,
`--cpu-check` runs part 1 on tiny shapes under the Triton interpreter (the tool's own test), and
`--sass` compiles every candidate for sm_90 with a launch's specialization (16-byte aligned
pointers, strides multiples of 16) and prints registers, stack (spill) bytes, shared memory and
the async / TMA copies of its loops (cuobjdump of the ptxas bundled with triton; ~2 min).

Research tool, not product code. Findings: docs/performance.md, "Long prefill (issue 28; fifteenth
session, h-prefill)".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any, NamedTuple

import torch

if "--cpu-check" in sys.argv:
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()

import minisgl.kernels.attention.extend as extend_mod  # noqa: E402
from minisgl.kernels.attention import extend_attention  # noqa: E402
from minisgl.kernels.attention.extend import _ExtendConfig  # noqa: E402

HQ, HKV, D, PAGE = 16, 8, 128, 16
# (name, cached prefix, new tokens): one request each.
CASES = [("32k", 0, 32768), ("16k|16k", 16384, 16384), ("8k", 0, 8192)]
POOL_SLOTS = 65536 + 1024
TABLE_WIDTH = 40960
REPS = 5
# (block_m, block_n, warps, stages, pack); the first is today's long-sequence default.
TILES = [
    (128, 64, 4, 3, True), (128, 64, 8, 2, True), (128, 64, 8, 3, True), (128, 64, 8, 4, True), (128, 32, 8, 3, True),
    (128, 128, 8, 2, True), (128, 128, 8, 3, True), (128, 64, 8, 3, False), (64, 64, 4, 3, True), (256, 64, 8, 3, True),
]  # fmt: skip
# (bulk, kv_load): today's masked loop, then the bulk path over each key source.
MODES = [(False, "gather"), (True, "gather"), (True, "run"), (True, "tma")]

class Candidate(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: bool
    bulk: bool
    kv_load: str

    @property
    def label(self) -> str:
        source = self.kv_load if self.bulk else "masked"
        tile = f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"
        return f"{tile}{' pk' if self.pack else ''} {source}"

    def config(self) -> _ExtendConfig:
        return _ExtendConfig(*self)

    def kwargs(self) -> dict[str, Any]:
        return self._asdict()


CANDIDATES = [Candidate(*tile, *mode) for tile in TILES for mode in MODES]


class Shape(NamedTuple):
    hq: int
    hkv: int
    d: int
    slots: int
    width: int
    dtype: torch.dtype


GPU_SHAPE = Shape(HQ, HKV, D, POOL_SLOTS, TABLE_WIDTH, torch.bfloat16)


def make_pool(shape: Shape, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(shape.slots, shape.hkv, shape.d, device=dev, generator=gen).to(shape.dtype)
    v = torch.randn(shape.slots, shape.hkv, shape.d, device=dev, generator=gen).to(shape.dtype)
    return k, v


def make_case(shape: Shape, prefix: int, new: int, run: bool, dev: torch.device, seed: int = 0) -> tuple:
    """extend_attention's positional args for one request of `prefix + new` positions: slots one run
    from slot 16 (`run`) or whole 16-token pages in a random order over the pool."""
    seq_len = prefix + new
    gen = torch.Generator().manual_seed(seed)
    if run:
        slots = torch.arange(PAGE, PAGE + seq_len)
    else:
        pages = torch.randperm(shape.slots // PAGE, generator=gen)[: (seq_len + PAGE - 1) // PAGE]
        pos = torch.arange(seq_len)
        slots = pages[pos // PAGE] * PAGE + pos % PAGE
    table = torch.zeros(2, shape.width, dtype=torch.int32)
    table[1, :seq_len] = slots.int()
    q = torch.randn(new, shape.hq, shape.d, generator=gen).to(shape.dtype)
    ints: dict[str, Any] = {"dtype": torch.int32, "device": dev}
    return (q.to(dev), table.to(dev), torch.tensor([1], device=dev), torch.tensor([seq_len], **ints),
            torch.tensor([new], **ints), torch.tensor([0], **ints))  # fmt: skip


def call(cand: Candidate | None, k: torch.Tensor, v: torch.Tensor, case: tuple) -> torch.Tensor:
    """One extend call: `cand`'s launch, or (None) the current default for this length."""
    q, table, rows, seq_lens, extend_lens, starts = case
    new = q.shape[0]
    kw = cand.kwargs() if cand is not None else {}
    return extend_attention(q, k, v, table, rows, seq_lens, extend_lens, starts, q.shape[2] ** -0.5,
                            max_extend_len=new, max_seq_len=1 << 20, **kw)  # fmt: skip (long: > 2048)


def _compile(index: int, shape: Shape) -> str:
    """Worker: compile candidate `index` (and the bases kernel) on a small request of the same
    layout, so that the parent finds it in Triton's disk cache."""
    dev = torch.device("cuda")
    k, v = make_pool(shape, dev)
    case = make_case(shape, 200, 300, True, dev)
    try:
        call(CANDIDATES[index], k, v, case)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # out of shared memory, a lowering the compiler refuses
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def precompile(shape: Shape, workers: int) -> dict[int, str]:
    """Every candidate compiled in `workers` spawned processes; -> {index: error} for failures
    (which the parent tries again: a worker that cannot start only costs the parallel compile)."""
    errors: dict[int, str] = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(_compile, i, shape): i for i in range(len(CANDIDATES))}
        for future in concurrent.futures.as_completed(futures):
            try:
                error = future.result()
            except Exception as exc:  # a worker that died (e.g. an illegal instruction)
                error = f"worker died: {type(exc).__name__}"
            if error:
                errors[futures[future]] = error
    return errors


def time_ms(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(within bf16 rounding of the reference, the relative max error)."""
    diff = (got.float() - ref.float()).abs()
    scale = ref.float().abs()
    rel_max = float(diff.max() / scale.max().clamp_min(1e-6))
    rel_mean = float(diff.mean() / scale.mean().clamp_min(1e-6))
    ok = bool(torch.isfinite(got).all()) and rel_max < 3e-2 and rel_mean < 1e-2
    return ok, rel_max


def flops(prefix: int, new: int, hq: int, d: int) -> float:
    return 4.0 * d * hq * (new * prefix + new * (new + 1) / 2)


def kernel_grid(shape: Shape, cases: list[tuple[str, int, int]], dev: torch.device, timed: bool,
                deadline: float = float("inf")) -> dict[str, dict[Candidate, float]]:  # fmt: skip
    """Part 1: {case: {candidate: ms}} (checked candidates only); prints each case best first.
    Past `deadline` (perf_counter) the remaining candidates are left out, and said so."""
    k, v = make_pool(shape, dev)
    results: dict[str, dict[Candidate, float]] = {}
    for name, prefix, new in cases:
        case = make_case(shape, prefix, new, True, dev)
        ref = call(None, k, v, case)
        work = flops(prefix, new, shape.hq, shape.d)
        rows: dict[Candidate, float] = {}
        failed: list[str] = []
        for cand in CANDIDATES:
            if time.perf_counter() > deadline:
                failed.append(f"{cand.label}: not run (out of --budget)")
                continue
            try:
                ok, err = check(call(cand, k, v, case), ref)
                if not ok:
                    failed.append(f"{cand.label}: differs from the default (rel max {err:.2e})")
                    continue
                rows[cand] = time_ms(lambda c=cand, a=case: call(c, k, v, a), REPS) if timed else err
            except Exception as exc:
                failed.append(f"{cand.label}: {type(exc).__name__}")
        results[name] = rows
        print(f"\n== {name}: prefix {prefix}, {new} new tokens, slots one run; {work / 1e12:.2f} TFLOP a layer")
        default = rows.get(CANDIDATES[0])
        for cand, ms in sorted(rows.items(), key=lambda item: item[1])[: 14 if timed else len(rows)]:
            if timed:
                speed = f"{default / ms:>6.3f}x" if default else ""
                print(f"  {cand.label:32} {ms:>9.3f} ms {work / ms / 1e9:>7.1f} TFLOP/s {speed}")
            else:
                print(f"  {cand.label:32} rel err {ms:.2e}")
        for line in failed:
            print(f"  skip {line}")
    return results


def ranking(results: dict[str, dict[Candidate, float]]) -> list[Candidate]:
    common = set.intersection(*(set(rows) for rows in results.values())) if results else set()
    ranked = sorted(common, key=lambda c: sum(rows[c] for rows in results.values()))
    base = sum(rows[CANDIDATES[0]] for rows in results.values()) if CANDIDATES[0] in common else None
    print("\n== ranking by the summed time of the cases (ms), best first")
    for cand in ranked[:10]:
        total = sum(rows[cand] for rows in results.values())
        print(f"  {cand.label:32} {total:>9.3f} ms{f' {base / total:>6.3f}x' if base else ''}")
    return ranked


def scattered(shape: Shape, leaders: list[Candidate], dev: torch.device) -> None:
    """The leaders on the 32k case with shuffled pages: what a request that is not one run pays."""
    k, v = make_pool(shape, dev)
    case = make_case(shape, 0, 32768, False, dev, seed=1)
    ref = call(None, k, v, case)
    print("\n== 32k with 16-token pages shuffled over the pool (the key sources fall back to the table)")
    for cand in [CANDIDATES[0], *leaders]:
        ok, err = check(call(cand, k, v, case), ref)
        ms = time_ms(lambda c=cand: call(c, k, v, case), REPS)
        print(f"  {cand.label:32} {ms:>9.3f} ms {'' if ok else f'DIFFERS (rel max {err:.2e})'}")


def whole_model() -> None:
    """Part 2: prefill wall time of the whole 0.6B shape at the current launch. The tool never
    swaps the engine's launch at run time (tests/unit/test_structure.py): to compare a leader in
    the whole model, make it the default in `_extend_config` and run this part again."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _workload import setup

    from minisgl.core import SamplingParams

    args = ["configs/qwen3-0.6b", "--num-seqs", "1", "--min-input", "8", "--max-input", "8", "--min-output", "1",
            "--max-output", "1", "--cache", "naive", "--cuda-graph-max-bs", "0", "--max-prefill-tokens", "32768",
            "--max-model-len", "33024", "--no-roofline"]  # fmt: skip
    _, _, _, llm = setup(args)
    planner = llm.scheduler.planner
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)

    def prefill(tokens: int) -> float:
        prompt = torch.randint(100, 100000, (tokens,), generator=gen).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    print("\n== whole model (bench offline's engine, Qwen3-0.6B shape, dummy weights): prefill wall s, median of 3")
    cells = []
    for chunk, tokens in ((8192, 8192), (8192, 32768), (16384, 32768), (32768, 32768)):
        planner.budget = chunk
        prefill(tokens)  # warm: compiles, allocator
        seconds = statistics.median(prefill(tokens) for _ in range(3))
        cells.append(f"{tokens // 1024}k@{chunk // 1024}k {seconds:.4f}")
    print(f"  {'current default':32} " + "  ".join(cells), flush=True)


def sass() -> None:
    """--sass: each candidate compiled for sm_90 (no GPU), its resources from the cubin."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = extend_mod._extend_kernel
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    strides = ["stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_ot", "stride_oh",
               "stride_table"]  # fmt: skip
    for cand in CANDIDATES:
        load = extend_mod._KV_LOADS[cand.kv_load] if cand.bulk else 0
        desc = f"tensordesc<bf16[{cand.block_n},{D}]>" if load == 2 else "*bf16"
        sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "table_ptr": "*i32",
               "rows_ptr": "*i64", "seq_lens_ptr": "*i32", "extend_lens_ptr": "*i32", "extend_starts_ptr": "*i32",
               "sinks_ptr": "*bf16", "kv_bases_ptr": "*i32" if load else "*i64", "k_desc": desc, "v_desc": desc,
               "qk_scale": "fp32", "cap_scale": "fp32", "v_scale": "fp32", "window": "i32",
               **{name: "i32" for name in strides}}  # fmt: skip
        consts = {"GROUP": HQ // HKV, "HEAD_DIM": D, "BLOCK_D": D, "BLOCK_M": cand.block_m, "BLOCK_N": cand.block_n,
                  "PRECISION": "tf32", "LAST_BLOCKS_FIRST": True, "PACK": cand.pack, "WINDOWED": False,
                  "SOFTCAP": False, "SINKS": False, "BULK": cand.bulk, "KV_LOAD": load, "PDL": True}  # fmt: skip
        names = fn.arg_names
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, kind in sig.items()
                 if kind.startswith("*") or n.startswith("stride") or n == "window"}  # fmt: skip
        try:
            kernel = triton.compile(
                ASTSource(fn, {**sig, **{n: "constexpr" for n in consts}}, constexprs=consts, attrs=attrs),
                target=GPUTarget("cuda", 90, 32), options={"num_warps": cand.num_warps, "num_stages": cand.num_stages},
            )  # fmt: skip
        except Exception as exc:
            print(f"  {cand.label:32} compile failed: {type(exc).__name__}")
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            dump = [str(cuobjdump), "-res-usage", cubin.name]
            usage = subprocess.run(dump, capture_output=True, text=True, check=False).stdout
        found = (re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage))
        regs, stack = (m.group(1) if m else "?" for m in found)
        ttgir = kernel.asm["ttgir"]
        print(f"  {cand.label:32} regs {regs:>3} stack {stack:>3} B "
              f"shared {kernel.metadata.shared:>6} B async copies {ttgir.count('async_copy_global_to_local'):>2} "
              f"TMA {ttgir.count('async_tma_copy_global_to_local')}", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the whole call (part 2 needs ~50)")
    parser.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--no-model", action="store_true", help="part 1 only")
    parser.add_argument("--cpu-check", action="store_true", help="part 1 on tiny shapes under the interpreter")
    parser.add_argument("--sass", action="store_true", help="compile each candidate for sm_90 (no GPU), resources")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.sass:
        sass()
        return 0
    if args.cpu_check:
        global CANDIDATES
        CANDIDATES = [Candidate(16, 16, 1, 1, pack, *mode) for pack in (False, True) for mode in MODES]
        CANDIDATES += [Candidate(32, 16, 1, 1, True, True, "tma")]
        shape = Shape(4, 2, 16, 512, 64, torch.float32)
        results = kernel_grid(shape, [("a", 0, 40), ("b", 37, 21)], torch.device("cpu"), False)
        assert all(len(rows) == len(CANDIDATES) for rows in results.values()), "a candidate failed"
        print("cpu check passed")
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --cpu-check)")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; {len(CANDIDATES)} candidates, {args.workers} compile workers", flush=True)
    errors = precompile(GPU_SHAPE, args.workers)
    print(f"compiled in {time.perf_counter() - start:.1f} s ({len(errors)} failed in the workers)", flush=True)
    for i, error in sorted(errors.items()):  # the grid below tries them again and lists what fails there
        print(f"  worker: {CANDIDATES[i].label}: {error}")
    results = kernel_grid(GPU_SHAPE, CASES, dev, True, start + args.budget - 20)
    ranked = ranking(results)
    leaders = [c for c in ranked if c != CANDIDATES[0]][:2]
    if ranked:
        best = ranked[0]
        print(f"\nbest kernel launch: {best.label}: in minisgl/kernels/attention/extend.py `_extend_config`, the "
              f"long (> 2048) launch for D 128, group 2 would be _ExtendConfig{tuple(best.config())}",
              flush=True)  # fmt: skip
    scattered(GPU_SHAPE, leaders, dev)
    torch.cuda.empty_cache()
    spent = time.perf_counter() - start
    print(f"\n(part 1: {spent:.1f} s)", flush=True)
    if args.no_model or args.budget - spent < 50:
        print("whole-model part skipped (--no-model, or under 50 s of --budget left)")
    else:
        try:
            whole_model()
        except Exception as exc:  # part 1's table stands on its own
            print(f"whole-model part failed: {type(exc).__name__}: {exc}")
    print(f"(total {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
