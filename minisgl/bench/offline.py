"""Offline throughput: a fixed random workload through `LLM.generate`, optionally through Hugging
Face transformers' continuous batching (`generate_batch`) in the same run. Prints one JSON line
per engine."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from minisgl.bench.roofline import bandwidth_of, floor
from minisgl.bench.workload import add_workload_args, make_workload
from minisgl.core import SamplingParams
from minisgl.server.engine_args import add_engine_args, check_engine_args, engine_config, scheduler_config


def make_llm(args: argparse.Namespace, tp_rank: int = 0, rdzv: Any = None) -> tuple[Any, Any]:
    """The `LLM` these bench args describe (rank `tp_rank` of `--tp`), warmed up once, and its TP
    group's store (None without TP), which the caller keeps alive while the engine runs."""
    from minisgl import LLM
    from minisgl.scheduler.process import _join_group

    # Rank r of a TP group runs on the r-th GPU (as the server's scheduler processes do).
    config, store = _join_group(engine_config(args, tp_rank=tp_rank), rdzv, device_index=tp_rank)
    llm = LLM(engine_config=config, scheduler_config=scheduler_config(args))
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=args.temperature, max_tokens=8), use_tqdm=False)  # warm-up
    return llm, store


def profiling_setup(argv: list[str]) -> tuple[argparse.Namespace, list[list[int]], list[int], Any]:
    """For the profiling scripts: `[MODEL] [bench args...]` (default model configs/qwen3-0.6b,
    dummy weights) -> (args, prompts, output lengths, an `LLM` already warmed up once)."""
    argv = list(argv)
    model = argv.pop(0) if argv and not argv[0].startswith("-") else "configs/qwen3-0.6b"
    args = build_parser().parse_args(["--model", model, "--dummy-weights", *argv])
    prompts, outputs = make_workload(args)
    llm, _ = make_llm(args)
    return args, prompts, outputs, llm


def run_minisgl(
    args: argparse.Namespace, prompts: list[list[int]], outputs: list[int], tp_rank: int = 0, rdzv: Any = None
) -> dict[str, Any]:
    # Measured before the engine takes the device's memory for its KV pool.
    bandwidth = bandwidth_of(args) if args.roofline and args.tp == 1 else None
    llm, _store = make_llm(args, tp_rank, rdzv)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outputs]
    llm.engine.platform.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=not args.quiet)
    llm.engine.platform.synchronize()
    seconds = time.perf_counter() - start
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    record = _record("minisgl", out_tokens, seconds, prompts, extra={"device": str(llm.engine.device),
                     "dtype": str(llm.engine.dtype).removeprefix("torch."), "attn": llm.engine.attn_name,
                     "tp": args.tp, "retractions": llm.scheduler.num_retractions})
    if bandwidth is not None:
        record.update(_roofline(args, llm, record["output_tok_s"], bandwidth))
    return record


def _roofline(args: argparse.Namespace, llm: Any, tok_s: float, bandwidth: float) -> dict[str, Any]:
    """The workload's decode memory floor (bench.roofline) at this engine's dtypes, and the share
    of it this run reached; also one line on stderr."""
    import sys

    engine = llm.engine
    kv_bytes = engine.pool.dtype.itemsize  # the pages' storage: 1 for fp8
    roof = floor(args, bandwidth, tok_s, dtype_bytes=(engine.dtype.itemsize, kv_bytes),
                 model=engine.model, config=engine.model_config)
    print(f"roofline: {roof['weight_bytes'] / 1e9:.2f} GB of weights and {roof['kv_bytes'] / 1e9:.2f} GB of KV "
          f"over {roof['bandwidth_tb_s']} TB/s = {roof['floor_s']} s ({roof['floor_tok_s']} tok/s); "
          f"this run: {tok_s} tok/s = {100 * roof['fraction_of_floor']:.1f} % of the floor", file=sys.stderr)  # fmt: skip
    keys = ("bandwidth_tb_s", "kv_bytes", "weight_bytes", "floor_s", "floor_tok_s", "fraction_of_floor")
    return {k: roof[k] for k in keys}


def _tp_rank_main(args: argparse.Namespace, rank: int, port: int, results: Any) -> None:
    """One rank of `--tp N` (spawned): every rank runs the same workload through its own
    scheduler, in lockstep through the collectives; each reports its record (or its error)."""
    from minisgl.distributed.group import Rendezvous

    try:
        prompts, outputs = make_workload(args)
        results.put((rank, run_minisgl(args, prompts, outputs, rank, Rendezvous("127.0.0.1", port, "bench", 600.0))))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def run_minisgl_tp(args: argparse.Namespace) -> dict[str, Any]:
    """`--tp N`: N spawned ranks (GPU r for rank r on CUDA, gloo on CPU); rank 0's record."""
    import multiprocessing as mp
    import queue

    from minisgl.distributed.group import host_store

    store = host_store("127.0.0.1", 0)  # the group's rendezvous, alive until every rank is done
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank_main, args=(args, rank, store.port, results)) for rank in range(args.tp)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < args.tp:
            if not any(proc.is_alive() for proc in procs) and results.empty():
                break
            try:
                rank, record = results.get(timeout=5.0)
            except queue.Empty:  # look at the processes again
                continue
            got[rank] = record
            if isinstance(record, str):
                break
    finally:
        for proc in procs:
            proc.join(30 if len(got) == args.tp else 1)
            if proc.is_alive():
                proc.kill()
    errors = {rank: rec for rank, rec in got.items() if isinstance(rec, str)}
    if errors or 0 not in got:
        raise RuntimeError(f"--tp {args.tp} failed: {errors or 'rank 0 never reported'}")
    return got[0]


def run_hf(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    """Transformers' own continuous batching. It takes one max_new_tokens for the whole batch, so
    every request gets the workload's mean output length (same total output tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from minisgl.models.source import resolve_model_dir
    from minisgl.platform import init_platform

    model_dir = resolve_model_dir(args.model)
    platform = init_platform(args.device)
    device = platform.device
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, platform.default_dtype
    )
    if args.dummy_weights:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model.eval()
    mean_out = round(sum(outputs) / len(outputs))
    gen = GenerationConfig(
        max_new_tokens=mean_out, do_sample=args.temperature > 0, temperature=args.temperature or None,
        eos_token_id=-1, pad_token_id=0,
    )
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=not args.quiet)
    platform.synchronize()
    seconds = time.perf_counter() - start
    out_tokens = sum(len(r.generated_tokens) for r in results.values())
    return _record("hf-transformers", out_tokens, seconds, prompts, extra={"device": str(device),
                   "note": f"uniform max_new_tokens={mean_out}"})


def _record(engine: str, out_tokens: int, seconds: float, prompts: list[list[int]], extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine": engine,
        "output_tokens": out_tokens,
        "seconds": round(seconds, 3),
        "output_tok_s": round(out_tokens / seconds, 1),
        "input_tokens": sum(len(p) for p in prompts),
        **extra,
    }


def build_parser() -> argparse.ArgumentParser:
    """The engine and scheduler flags of `python -m minisgl` (server/engine_args.py; `--seed` also
    seeds the workload), then the workload's."""
    p = argparse.ArgumentParser(prog="python -m minisgl.bench offline", description=__doc__)
    add_engine_args(p, offline=True)
    add_workload_args(p)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--peer", choices=["hf"], action="append", default=[], help="also run a peer engine")
    p.add_argument("--no-minisgl", action="store_true", help="run only the peer(s)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory bandwidth in TB/s for the decode floor (default: measured on the device)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip the decode memory floor printed beside the run (bench.roofline)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_engine_args(args)
    if problem is not None:
        parser.error(problem)
    prompts, outputs = make_workload(args)
    if not args.no_minisgl:
        record = run_minisgl_tp(args) if args.tp > 1 else run_minisgl(args, prompts, outputs)
        print(json.dumps(record), flush=True)
    if "hf" in args.peer:
        print(json.dumps(run_hf(args, prompts, outputs)), flush=True)
    return 0
