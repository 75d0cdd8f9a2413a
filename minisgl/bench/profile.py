"""Where the offline workload's time goes: `python -m minisgl.bench profile MODE [options]`.

The workload and engine options are `bench offline`'s (default: its 256 random prompts; on a CPU
pass a small one, e.g. `--device cpu --num-seqs 4 --min-input 16 --max-input 64 --min-output 8
--max-output 16`). Modes:

  steps    every scheduler step timed (wall clock around `Scheduler.step`), summed by kind: steps
           that admit or prefill requests, and decode steps by batch size; plus the host time to
           queue the prompts and the first step's time.
  host     the workload under cProfile, after one unprofiled run for the wall time per step: host
           time per step of the minisgl functions with the most cumulative time and of all
           functions by own time. On CUDA the device runs asynchronously, so this is the cost of
           planning and launching; the time blocked on the device shows in `LaunchedStep.result`.
  table    torch.profiler over the run, or over steps A to B (`--window A-B`): the ops (and on
           CUDA the kernels) with the most self time. `--trace-out F` writes the Chrome trace. With
           device events (CUDA) it adds the device's busy share, idle gaps between kernels by size
           and the op pairs around the longest, and the CUDA runtime calls by host time.
  decode   wall time of one decode step at the workload's batch: runs that differ only in output
           length (`--short`, `--long` tokens each), so prefill cancels out.
  prefill  wall time of prefilling the workload's prompts (one output token each; every run takes
           fresh prompts so that nothing comes from the prefix cache).

Timing goes through the scheduler's public calls (`add_request`, `step`, `has_work`) and the
profilers' own hooks; nothing in the engine is replaced.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from minisgl.core import SamplingParams

MODES = ("steps", "host", "table", "decode", "prefill")
# Decode steps are summed by batch size in these bands.
BANDS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 1 << 30))
_RIDS = itertools.count(1 << 40)  # apart from the ids `LLM.generate` hands out


class StepTime(NamedTuple):
    kind: str
    seconds: float


class Run(NamedTuple):
    steps: list[StepTime]
    queue_seconds: float  # adding every request, before the first step
    seconds: float  # the whole run, device synchronized at the end
    output_tokens: int


def step_kind(scheduler: Any) -> str:
    """What the next step carries: `admit/prefill` while requests wait or prefill, else the decode band."""
    stats = scheduler.stats()
    if stats.waiting or any(req.cached_len < req.prompt_len for req in scheduler.running):
        return "admit/prefill"
    lo, hi = next(band for band in BANDS if band[0] <= stats.running <= band[1])
    return f"decode {lo}-{hi}" if hi < 1 << 30 else f"decode {lo}+"


def drive(llm: Any, prompts: list[list[int]], params: list[SamplingParams],
          on_step: Callable[[int], None] | None = None) -> Run:  # fmt: skip
    """Queue every prompt and step the scheduler until all finish, timing each step. `on_step(n)`
    runs before step n (outside its timing) and once more after the last one."""
    scheduler, platform = llm.scheduler, llm.engine.platform
    platform.synchronize()
    start = time.perf_counter()
    live: set[int] = set()
    try:
        for ids, sampling in zip(prompts, params):
            rid = next(_RIDS)
            scheduler.add_request(rid, ids, sampling)
            live.add(rid)
        queued = time.perf_counter()
        steps: list[StepTime] = []
        tokens = 0
        while scheduler.has_work():
            if on_step is not None:
                on_step(len(steps))
            kind = step_kind(scheduler)
            begin = time.perf_counter()
            outputs = scheduler.step()
            steps.append(StepTime(kind, time.perf_counter() - begin))
            for out in outputs:
                tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    live.discard(out.rid)
        if on_step is not None:
            on_step(len(steps))
        platform.synchronize()
    except BaseException:
        for rid in live:
            scheduler.abort(rid)
        raise
    return Run(steps, queued - start, time.perf_counter() - start, tokens)


def _params(args: argparse.Namespace, outputs: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]


def _shifted(args: argparse.Namespace, prompts: list[list[int]], shift: int) -> list[list[int]]:
    """The prompts with every id moved by `shift` (within the workload's id range): no prefix hits."""
    return [[(t + shift) % (args.max_token_id + 1) for t in p] for p in prompts]


def _run_summary(run: Run) -> str:
    steps = len(run.steps)
    first = f"{run.steps[0].seconds * 1e3:.2f}" if run.steps else "-"
    return (f"{steps} steps, {run.output_tokens} output tokens in {run.seconds:.3f} s "
            f"({run.output_tokens / run.seconds:.1f} tok/s); queueing {run.queue_seconds * 1e3:.2f} ms, "
            f"first step {first} ms")  # fmt: skip


def profile_steps(llm: Any, args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> list[str]:
    run = drive(llm, prompts, _params(args, outputs))
    kinds: dict[str, list[float]] = {}
    for step in run.steps:
        kinds.setdefault(step.kind, []).append(step.seconds)
    order = sorted(kinds, key=lambda k: -1 if k.startswith("admit") else int(k.split()[1].split("-")[0].rstrip("+")))
    lines = [_run_summary(run), f"{'step kind':16} {'steps':>6} {'wall s':>8} {'ms/step':>8} {'max ms':>8}"]
    for kind in order:
        times = kinds[kind]
        total = sum(times)
        lines.append(f"{kind:16} {len(times):>6} {total:>8.3f} {total / len(times) * 1e3:>8.3f} {max(times) * 1e3:>8.3f}")
    lines.append(f"{'all steps':16} {len(run.steps):>6} {sum(s.seconds for s in run.steps):>8.3f}")
    return lines


def _label(func: tuple[str, int, str], root: Path) -> str:
    file, line, name = func
    path = Path(file)
    where = str(path.relative_to(root.parent)) if path.is_relative_to(root.parent) else path.name
    return f"{name} ({where}:{line})" if line else name


def profile_host(llm: Any, args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> list[str]:
    import minisgl

    root = Path(minisgl.__file__).parent
    plain = drive(llm, prompts, _params(args, outputs))
    profiler = cProfile.Profile()
    profiler.enable()
    run = drive(llm, _shifted(args, prompts, 1), _params(args, outputs))
    profiler.disable()
    steps = max(len(run.steps), 1)
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    this_file = str(Path(__file__).resolve())
    ours = [(func, row) for func, row in stats.items()
            if Path(func[0]).resolve().is_relative_to(root) and str(Path(func[0]).resolve()) != this_file]  # fmt: skip
    wall = sum(s.seconds for s in plain.steps) / max(len(plain.steps), 1)
    lines = [f"unprofiled: {_run_summary(plain)}; {wall * 1e3:.3f} ms per step (wall)",
             f"under cProfile: {_run_summary(run)}",
             "minisgl functions by cumulative host time (ms/step cumulative, ms/step own, calls/step):"]  # fmt: skip
    for func, (_, calls, own, cumulative, _) in sorted(ours, key=lambda kv: -kv[1][3])[: args.rows]:
        per_step = f"{cumulative / steps * 1e3:8.3f} {own / steps * 1e3:8.3f} {calls / steps:8.1f}"
        lines.append(f"  {per_step}  {_label(func, root)}")
    lines.append("all functions by own host time (ms/step, calls/step):")
    for func, (_, calls, own, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.rows]:
        lines.append(f"  {own / steps * 1e3:8.3f} {calls / steps:8.1f}  {_label(func, root)}")
    return lines


def _window(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit()) or int(first) >= int(last):
        raise ValueError(f"--window takes A-B with A < B (steps), got {text!r}")
    return int(first), int(last)


def profile_table(llm: Any, args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from minisgl.bench.trace_report import device_report, load_events, runtime_report

    platform = llm.engine.platform
    cuda = platform.name == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    window = _window(args.window) or (0, 1 << 62)
    prof = profile(activities=activities)
    state = {"open": False, "steps": 0}

    def on_step(n: int) -> None:
        if n == window[0]:
            prof.__enter__()
            state["open"] = True
        elif state["open"] and n >= window[1]:
            platform.synchronize()
            prof.__exit__(None, None, None)
            state["open"], state["steps"] = False, n - window[0]

    run = drive(llm, prompts, _params(args, outputs), on_step)
    if state["open"]:  # the run ended inside the window
        platform.synchronize()
        prof.__exit__(None, None, None)
        state["steps"] = len(run.steps) - window[0]
    if not state["steps"]:
        return [_run_summary(run), f"the run had {len(run.steps)} steps: nothing in --window {args.window}"]
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines = [_run_summary(run), f"profiled steps {window[0]}-{window[0] + state['steps']}",
             prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70)]  # fmt: skip
    if args.trace_out or cuda:
        path = args.trace_out or str(Path(tempfile.gettempdir()) / "minisgl_profile_trace.json")
        prof.export_chrome_trace(path)
        events = load_events(path)
        lines += [*device_report(events, state["steps"], args.rows), *runtime_report(events, args.rows)]
        lines.append(f"Chrome trace: {path}")
    return lines


def _timed_generate(llm: Any, prompts: list[list[int]], params: SamplingParams) -> float:
    llm.engine.platform.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.platform.synchronize()
    return time.perf_counter() - start


def profile_decode(llm: Any, args: argparse.Namespace, prompts: list[list[int]], _: list[int]) -> list[str]:
    if not 0 < args.short < args.long:
        raise ValueError(f"decode needs 0 < --short < --long, got {args.short} and {args.long}")

    def params(tokens: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=tokens)

    _timed_generate(llm, prompts, params(args.short))  # warm-up: compiles, the prefix cache
    short = min(_timed_generate(llm, prompts, params(args.short)) for _ in range(args.repeat))
    long = min(_timed_generate(llm, prompts, params(args.long)) for _ in range(args.repeat))
    step_ms = (long - short) / (args.long - args.short) * 1e3
    lengths = [len(p) for p in prompts]
    return [f"{len(prompts)} requests, prompts of {min(lengths)}-{max(lengths)} tokens: {step_ms:.3f} ms per decode "
            f"step (wall), {len(prompts) / step_ms * 1e3:.0f} tok/s (best of {args.repeat}: {short:.3f} s for "
            f"{args.short} tokens, {long:.3f} s for {args.long})"]  # fmt: skip


def profile_prefill(llm: Any, args: argparse.Namespace, prompts: list[list[int]], _: list[int]) -> list[str]:
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1)
    _timed_generate(llm, _shifted(args, prompts, 1), params)  # warm-up
    times = [_timed_generate(llm, _shifted(args, prompts, 2 + k), params) for k in range(args.repeat)]
    tokens = sum(len(p) for p in prompts)
    median = statistics.median(times)
    return [f"prefill of {len(prompts)} prompts, {tokens} tokens: {median * 1e3:.2f} ms wall (median of "
            f"{args.repeat}, best {min(times) * 1e3:.2f}), {tokens / median:.0f} tok/s"]  # fmt: skip


PROFILES: dict[str, Callable[[Any, argparse.Namespace, list[list[int]], list[int]], list[str]]] = {
    "steps": profile_steps, "host": profile_host, "table": profile_table,
    "decode": profile_decode, "prefill": profile_prefill,
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from minisgl.bench.offline import build_parser as offline_parser

    p = argparse.ArgumentParser(
        prog="python -m minisgl.bench profile", description=__doc__, add_help=False, parents=[offline_parser()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("mode", choices=MODES)
    p.add_argument("--rows", type=int, default=25, help="rows of each table (host, table)")
    p.add_argument("--window", default=None, help="table: profile steps A to B only (A-B)")
    p.add_argument("--trace-out", default=None, help="table: write the Chrome trace here")
    p.add_argument("--short", type=int, default=16, help="decode: output tokens of the short runs")
    p.add_argument("--long", type=int, default=144, help="decode: output tokens of the long runs")
    p.add_argument("--repeat", type=int, default=3, help="decode, prefill: timed runs of each")
    return p


def main(argv: list[str]) -> int:
    from minisgl.bench.offline import make_llm
    from minisgl.bench.workload import make_workload

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tp != 1 or args.peer or args.no_minisgl:
        parser.error("profile runs minisgl on one rank (no --tp, --peer or --no-minisgl)")
    if args.repeat < 1 or args.rows < 1:
        parser.error("--repeat and --rows take a positive count")
    if not (0 < args.min_input <= args.max_input and 0 < args.min_output <= args.max_output):
        parser.error("the workload needs 0 < --min-input <= --max-input and 0 < --min-output <= --max-output")
    try:
        _window(args.window)
    except ValueError as exc:
        parser.error(str(exc))
    prompts, outputs = make_workload(args)
    llm, _store = make_llm(args)
    engine = llm.engine
    print(f"== profile {args.mode}: {args.model or 'the embedded model'} on {engine.device}, "
          f"{str(engine.dtype).removeprefix('torch.')}, attention {engine.attn_name}", flush=True)  # fmt: skip
    try:
        lines = PROFILES[args.mode](llm, args, prompts, outputs)
    except ValueError as exc:
        parser.error(str(exc))
    print("\n".join(lines), flush=True)
    return 0
