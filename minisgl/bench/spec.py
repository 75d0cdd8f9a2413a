"""Speculative decoding: single-stream decode speed with and without it, on a workload whose answers
copy from the prompt (bench/spec_workload.py), greedy, one request at a time. Prints one JSON line
per run (`speculative: false`, then the flags' algorithm) and a summary line: speed-up, whether the
texts are identical, acceptance rate and mean accepted length. On CPU with the embedded model's
GGUF weights, K = 3 pays best: a verify step's 4 rows fit one register tile of the quantized GEMV
(kernels/cpu_quant.py), 5 rows take two: `python -m minisgl.bench spec --device cpu
--speculative-algorithm ngram --num-speculative-tokens 3 --max-tokens 128`.

`--verify-cost`: instead, the time of one bs=1 step that verifies K proposed tokens (K + 1 query
rows; every step proposes K tokens, whatever the model) against one plain decode step, e.g. on the
GPU with dummy weights: `python -m minisgl.bench spec --verify-cost --model configs/qwen3-0.6b
--dummy-weights --speculative-algorithm ngram --num-speculative-tokens 4`. It also times plain
decoding without overlap scheduling (`decode_sync`: a verify step waits for its tokens before the
next step is planned). `<run>_step_ms` is the median time of one scheduler step in the steady
state (the scheduler driven directly, as the server's scheduler process runs it: prefill, the
last steps and detokenizing left out); `<run>_mean_ms` the older figure, an `LLM.generate`'s
time over its steps (the prefill included). Per run it prints the CUDA graph sizes, replays and
eager runs, the host milliseconds per step phase (`host_phases`, from a pass under cProfile), and
on CUDA `replay_device_ms`: the device time of one replay of each captured graph (back-to-back replays between two synchronizations,
`--prompt-len` + half `--max-tokens` tokens of context per entry), so that a step's time less its
graph's device time is the host time it exposes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import pstats
import statistics
import time
from dataclasses import replace
from typing import Any

from minisgl.core import Req, SamplingParams
from minisgl.server.engine_args import (
    add_engine_args,
    check_engine_args,
    engine_config,
    scheduler_config,
)


class FixedProposer:
    """Proposes `limit` copies of the newest token for every request (a cost probe, not a guess)."""

    def propose(self, reqs: list[tuple[Req, int]]) -> dict[int, list[int]]:
        return {req.rid: [(req.output_ids or req.prompt_ids)[-1]] * limit for req, limit in reqs}

    def forget(self, req: Req) -> None:
        pass

    def check_idle(self) -> None:
        pass


def _llm(args: argparse.Namespace, speculative: bool) -> Any:
    from minisgl import LLM

    sched = scheduler_config(args)
    if not speculative:
        sched = replace(sched, speculative_algorithm=None, speculative_draft_model=None)
    # No prefix cache: a request's prefill costs the same in the 1-token run and the full one.
    sched = replace(sched, max_running_requests=1, cache="naive")
    llm = LLM(engine_config=engine_config(args), scheduler_config=sched)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def _spec_record(llm: Any) -> dict[str, Any]:
    spec = llm.scheduler.spec
    if spec is None:
        return {}
    stats = spec.stats
    return {"verify_steps": stats.verify_steps, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens, "acceptance_rate": round(stats.acceptance_rate, 3),
            "mean_accepted_len": round(stats.mean_accepted_len, 3)}  # fmt: skip


def run_workload(args: argparse.Namespace, speculative: bool) -> tuple[dict[str, Any], list[str]]:
    from minisgl.bench.spec_workload import CONVERSATIONS

    llm = _llm(args, speculative)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS] * args.repeat
    if llm.scheduler.spec is not None:
        llm.scheduler.spec.stats = type(llm.scheduler.spec.stats)()  # not the warm-up's
    texts: list[str] = []
    tokens, seconds = 0, 0.0
    for prompt in prompts:  # single stream: one request at a time; decode time only
        start = time.perf_counter()
        first = llm.generate([prompt], replace(params, max_tokens=1), use_tqdm=False)[0]
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start - prefill  # the decode steps after the first token
        tokens += len(out.token_ids) - 1
        texts.append(out.text)
        assert first.outputs[0].token_ids == out.token_ids[:1]
    record = {"speculative": llm.scheduler.config.speculative_algorithm or False, "requests": len(prompts),
              "decode_tokens": tokens, "decode_seconds": round(seconds, 3),
              "decode_tok_s": round(tokens / seconds, 2), **_spec_record(llm)}  # fmt: skip
    return record, texts


# Host phases of a step (`host_phases`): (file, function) as cProfile names them.
_PHASES = {
    "plan": ("scheduler/scheduler.py", "_plan"),  # the scheduler's plan, proposals included
    "build": ("engine/engine.py", "_build"),  # the engine's batch (host lists, uploads, token table)
    "forward": ("engine/graph.py", "run"),  # a graph replay's copies and launch, or an eager forward
    "sample": ("engine/sampler.py", "sample"),
    "launch": ("engine/engine.py", "launch"),  # build + forward + sample + the rest of the launch
    "wait": ("engine/step.py", "result"),  # for the device and the tokens' host copy
    "complete": ("scheduler/scheduler.py", "_complete"),  # wait + acceptance and the outputs
}


def host_phases(llm: Any, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """Host milliseconds per step of each phase of the steady-state steps of one request (the
    steps `step_ms` times: the prefill's eager forward and build left out, which a pass of ~50
    verify steps would otherwise spread over each at 5x the share of ~250 decode steps), measured
    with cProfile (its own cost inflates every phase, so read them against each other):
    `launch_rest` is the launch less build, forward and sample; `complete` excludes the wait;
    `other` is the rest."""
    profile = cProfile.Profile()
    sched = llm.scheduler
    sched.add_request(1 << 40, prompt, params)
    wall, count = 0.0, 0
    while sched.has_work():
        count += 1
        steady = 3 < count <= params.max_tokens // 8  # well inside [3:-6] whether a step commits 1 or K + 1
        start = time.perf_counter()
        if steady:
            profile.runcall(sched.step)
            wall += time.perf_counter() - start
        else:
            sched.step()
    llm.engine.platform.synchronize()
    table = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    seconds = dict.fromkeys(_PHASES, 0.0)
    steps = 0
    for (path, _, func), (_, calls, _, cumulative, _) in table.items():
        for phase, (suffix, name) in _PHASES.items():
            if func == name and path.replace("\\", "/").endswith(suffix):
                # The outermost call of a name (a graph runner's eager fallback is nested in it).
                seconds[phase] = max(seconds[phase], cumulative)
                if phase == "plan":  # one plan per scheduler step
                    steps = max(steps, calls)
    s = dict(seconds)
    s["launch_rest"] = s.pop("launch") - s["build"] - s["forward"] - s["sample"]
    s["complete"] -= s["wait"]
    s["other"] = wall - sum(s.values())
    per_step = {phase: round(1000 * value / max(steps, 1), 3) for phase, value in s.items()}
    return {"steps": steps, "ms_per_step": per_step, "wall_ms_per_step": round(1000 * wall / max(steps, 1), 3)}


def _graph_record(llm: Any, before: tuple[int, int]) -> dict[str, Any]:
    """Whether the timed steps replayed CUDA graphs (captured entry counts, replays, eager runs)."""
    runner = llm.engine.runner
    sizes = getattr(runner, "sizes", None)
    if sizes is None:
        return {"graphs": None}  # an eager runner (no CUDA graphs on this device / config)
    return {"graphs": sizes, "replays": runner.replays - before[0], "eager_runs": runner.eager_runs - before[1]}


def step_ms(llm: Any, prompt: list[int], params: SamplingParams) -> float:
    """Median milliseconds of one `Scheduler.step()` generating `params.max_tokens` tokens of
    `prompt` (the scheduler driven directly), the first 3 steps (prefill) and the last 6 (where
    fewer than K proposals fit) left out."""
    sched = llm.scheduler
    rid = 1 << 40  # no id LLM.generate hands out
    sched.add_request(rid, prompt, params)
    times: list[float] = []
    while sched.has_work():
        start = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - start)
    llm.engine.platform.synchronize()
    steady = times[3:-6] or times
    return round(1000 * statistics.median(steady), 3)


def replay_device_ms(llm: Any, context: int, reps: int = 50) -> dict[str, float] | None:
    """Device milliseconds of one replay of each captured graph (`reps` back-to-back replays
    between two synchronizations), every entry attending `context` tokens of the scratch row (KV written to
    the scratch slot); None without graphs. Run with no request resident."""
    import torch

    runner = llm.engine.runner
    if getattr(runner, "graphs", None) is None:
        return None
    out: dict[str, float] = {}
    with torch.inference_mode():  # the runner's static buffers are inference tensors
        for bs, graph in sorted(runner.graphs.items()):
            out[str(bs)] = _replay_ms(llm.engine.platform, runner, graph, bs, context, reps)
        runner.seq_lens.zero_()
    return out


def _replay_ms(platform: Any, runner: Any, graph: Any, bs: int, context: int, reps: int) -> float:
    """One graph's milliseconds per replay (see `replay_device_ms`): `reps` back-to-back replays
    between two device synchronizations, so the device runs them without gaps."""
    runner.out_loc[:bs].fill_(runner.scratch_slot)
    runner.slots32[:bs].fill_(runner.scratch_slot)  # the graph's table write: the scratch row's position 0
    runner.positions[:bs].zero_()
    runner.rows[:bs].fill_(runner.scratch_row)
    runner.seq_lens[:bs].fill_(context)
    runner.backend.prepare_for_replay(runner._static_batch(bs, [context] * bs))
    graph.replay()  # warm
    platform.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    platform.synchronize()
    return round((time.perf_counter() - start) * 1e3 / reps, 3)


def run_verify_cost(args: argparse.Namespace) -> dict[str, Any]:
    """bs=1: step time of plain decoding (as configured, then without overlap scheduling) and of
    verify steps of K proposals (FixedProposer; as configured, then, where the outputs were
    deferred, `verify_sync` without that); per run, the graph replays and eager runs of the timed
    pass, the host time per phase of a profiled pass (`host_phases`), and per engine the device
    time of each graph's replay.

    Each engine runs in a process of its own, as a server's does. Both run one request at a time
    (max_running_requests 1), so the plain engine holds only the bs=1 graph, which replays ~9 %
    faster than the same graph in a runner that also holds larger ones (H200: 0.903 vs 0.984 ms;
    docs/speculative.md), as the verify engine's does."""
    k = args.num_speculative_tokens
    out: dict[str, Any] = {"k": k}
    spawn = multiprocessing.get_context("spawn")
    for speculative in (False, True):
        with spawn.Pool(1) as pool:
            out.update(pool.apply(_engine_costs, (args, speculative)))
    out["verify_over_decode"] = round(out["verify_step_ms"] / out["decode_step_ms"], 3)
    out["verify_over_decode_sync"] = round(out["verify_step_ms"] / out["decode_sync_step_ms"], 3)
    out["verify_over_decode_mean"] = round(out["verify_mean_ms"] / out["decode_mean_ms"], 3)
    return out


def _set_mode(sched: Any, speculative: bool, on: bool) -> None:
    """Deferred outputs on or off (a speculating engine), or overlap scheduling (a plain one)."""
    if speculative:
        sched.defer_outputs = on
    else:
        sched.overlap = on


def _engine_costs(args: argparse.Namespace, speculative: bool) -> dict[str, Any]:
    """One engine's runs of `run_verify_cost`: decode and decode_sync, or verify and verify_sync."""
    k = args.num_speculative_tokens
    steps = args.max_tokens
    prompt = list(range(10, 10 + args.prompt_len))
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    out: dict[str, Any] = {}
    llm = _llm(args, speculative)
    names = ("verify", "verify_sync") if speculative else ("decode", "decode_sync")
    sched = llm.scheduler
    # The second mode of this engine: each step waited for before the next is planned (decode),
    # or each step's outputs returned before the next launch (verify; none where the first was that).
    first = sched.defer_outputs if speculative else sched.overlap
    modes = {names[0]: first, names[1]: False} if first or not speculative else {names[0]: first}
    # `<run>_step_ms`: the median of passes alternating the modes (run order and drift cancel).
    passes: dict[str, list[float]] = {name: [] for name in modes}
    if speculative:
        sched.spec.proposer = FixedProposer()
    llm.generate([prompt], params, use_tqdm=False)  # warm-up at these lengths
    for _ in range(args.passes):
        for name, value in modes.items():
            _set_mode(sched, speculative, value)
            passes[name].append(step_ms(llm, prompt, params))
    for name, value in modes.items():
        _set_mode(sched, speculative, value)
        llm.generate([prompt], params, use_tqdm=False)  # warm-up in this mode
        if speculative:
            sched.spec.stats = type(sched.spec.stats)()
        runner = llm.engine.runner
        before = (getattr(runner, "replays", 0), getattr(runner, "eager_runs", 0))
        platform = llm.engine.platform
        platform.synchronize()
        start = time.perf_counter()
        res = llm.generate([prompt], params, use_tqdm=False)[0]
        platform.synchronize()
        total = time.perf_counter() - start
        assert len(res.outputs[0].token_ids) == steps
        count = steps - 1 if not speculative else sched.spec.stats.verify_steps
        out[f"{name}_mean_ms"] = round(1000 * total / max(count, 1), 3)
        detail = {"overlap": sched.overlap, "deferred_outputs": sched.defer_outputs,
                  **_graph_record(llm, before), **_spec_record(llm)}  # fmt: skip
        out[f"{name}_step_ms"] = round(statistics.median(passes[name]), 3)
        detail["step_ms_passes"] = passes[name]
        # Again under cProfile, for the host time per phase.
        detail["host_phases"] = host_phases(llm, prompt, params)
        if name in ("decode_sync", "verify"):  # once per engine
            try:  # a diagnostic: its failure must not lose the timings
                device = replay_device_ms(llm, args.prompt_len + steps // 2)
            except Exception as exc:  # noqa: BLE001
                device = None
                detail["replay_device_error"] = repr(exc)
            detail["replay_device_ms"] = device
            size = "1" if name == "decode_sync" else str(k + 1)
            if device is not None and size in device:  # the step's time less its graph's device time
                out[f"{name}_exposed_host_ms"] = round(out[f"{name}_step_ms"] - device[size], 3)
        out[name] = detail
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl.bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(p, offline=True)
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (default: 256)")
    p.add_argument("--repeat", type=int, default=1, help="passes over the workload (default: 1)")
    p.add_argument("--verify-cost", action="store_true", help="time a verify step against a decode step instead")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of --verify-cost (default: 128)")
    p.add_argument("--passes", type=int, default=3,
                   help="--verify-cost: timed passes per mode, the two modes of an engine alternating (default: 3)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_engine_args(args)
    if problem is None and args.speculative_algorithm is None:
        problem = "pass --speculative-algorithm (ngram or draft)"
    if problem is not None:
        parser.error(problem)
    if args.verify_cost:
        print(json.dumps(run_verify_cost(args)), flush=True)
        return 0
    base, base_texts = run_workload(args, speculative=False)
    print(json.dumps(base), flush=True)
    spec, spec_texts = run_workload(args, speculative=True)
    print(json.dumps(spec), flush=True)
    summary = {"speedup": round(spec["decode_tok_s"] / base["decode_tok_s"], 3),
               "identical_text": base_texts == spec_texts,
               "acceptance_rate": spec.get("acceptance_rate"), "mean_accepted_len": spec.get("mean_accepted_len")}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0
