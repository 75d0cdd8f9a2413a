"""Tensor parallelism over gloo, offline: every rank runs the real scheduler and engine on its
shard; greedy token ids equal TP=1 token for token on tiny random Llama (tied embeddings, llama3
rope scaling), Qwen3 (q/k norms, head_dim != hidden / heads), Gemma 3 (sliding-window layers,
Gemma norms, GeGLU) and Phi-3 (fused qkv / gate_up checkpoint tensors split per rank, partial
rotary, LongRoPE) split over 2 ranks, and on Llama and OLMo 2 (q/k norms over the whole
projection: a sum of squares all-reduced across ranks) split over 4 ranks, where their 2
key/value heads are replicated (two ranks share each). With two
CUDA devices, the same check over NCCL in fp32 (rank r on GPU r, CUDA graphs on)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.config import EngineConfig
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.tp

NEW_TOKENS = 12
RANK_TIMEOUT = 240.0


def _prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 40)]


def _engine_config(model_dir: str, rank: int = 0, size: int = 1, device: str = "cpu") -> EngineConfig:
    if device == "cuda":
        return EngineConfig(model=model_dir, device=f"cuda:{rank}", dtype="float32", page_size=16,
                            num_pages=64, tp_rank=rank, tp_size=size, cuda_graph_max_bs=8)  # fmt: skip
    return EngineConfig(model=model_dir, device="cpu", dtype="float32", page_size=4, num_pages=64, tp_rank=rank,
                        tp_size=size)  # fmt: skip


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(_prompts(), params, use_tqdm=False)]


def _rank_main(rank: int, size: int, model_dirs: list[str], port: int, results: Any, device: str) -> None:
    """One TP rank (spawned): join the group through the store once, then for each model in turn
    build the engine on its shard, run the prompts and report (model_dir, rank, ids, params)."""
    import gc

    try:
        from minisgl.distributed.group import Rendezvous, init_tp_group

        if device == "cuda":
            import torch

            torch.cuda.set_device(rank)
        backend = "nccl" if device == "cuda" else "gloo"
        init_tp_group(Rendezvous("127.0.0.1", port, "parity", RANK_TIMEOUT), rank, size, backend)
    except BaseException as exc:
        for model_dir in model_dirs:
            results.put((model_dir, rank, f"{type(exc).__name__}: {exc}", 0))
        raise
    for model_dir in model_dirs:
        try:
            llm = LLM(engine_config=_engine_config(model_dir, rank, size, device))
            params = sum(p.numel() for p in llm.engine.model.parameters())
            results.put((model_dir, rank, _greedy(llm), params))
            del llm
            gc.collect()
        except BaseException as exc:
            results.put((model_dir, rank, f"{type(exc).__name__}: {exc}", 0))
            raise


def _run_tp_many(model_dirs: list[Path], size: int, device: str = "cpu") -> dict[str, dict[int, tuple[Any, int]]]:
    """One group of `size` spawned ranks runs every model of `model_dirs` in turn (a spawn and the
    group's start once, not once per model): {model_dir: {rank: (ids or an error, parameters)}}."""
    from minisgl.distributed.group import host_store

    store = host_store("127.0.0.1", 0)  # kept alive until every rank is done
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    dirs = [str(d) for d in model_dirs]
    procs = [ctx.Process(target=_rank_main, args=(rank, size, dirs, store.port, results, device))
             for rank in range(size)]  # fmt: skip
    for proc in procs:
        proc.start()
    got: dict[str, dict[int, tuple[Any, int]]] = {d: {} for d in dirs}
    try:
        while sum(map(len, got.values())) < size * len(dirs):
            model_dir, rank, ids, params = results.get(timeout=RANK_TIMEOUT)
            got[model_dir][rank] = (ids, params)
    except queue.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return got


def _run_tp(model_dir: Path, size: int, device: str = "cpu") -> dict[int, tuple[Any, int]]:
    got = _run_tp_many([model_dir], size, device)[str(model_dir)]
    assert len(got) == size, f"ranks {sorted(set(range(size)) - set(got))} never reported"
    return got


CASES = [("llama", 2), ("qwen3", 2), ("gemma3", 2), ("phi3", 2), ("llama", 4), ("olmo2", 4)]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], tuple[Path, dict[int, tuple[Any, int]]]]:
    """The TP results of every case, one rank group per size (run on first use, then kept):
    (the model's directory, {rank: (ids, parameters)})."""
    dirs = {case: tmp_path_factory.mktemp(f"{case[0]}_tp{case[1]}") for case in CASES}
    runs: dict[int, dict[str, dict[int, tuple[Any, int]]]] = {}

    def run(arch: str, size: int) -> tuple[Path, dict[int, tuple[Any, int]]]:
        if size not in runs:
            group = [case for case in CASES if case[1] == size]
            for case in group:
                make_tiny_model(case[0], dirs[case])
            runs[size] = _run_tp_many([dirs[case] for case in group], size)
        got = runs[size][str(dirs[arch, size])]
        assert len(got) == size, f"ranks {sorted(set(range(size)) - set(got))} never reported"
        return dirs[arch, size], got

    return run


@pytest.mark.parametrize("arch, size", CASES)
def test_tp_greedy_equals_tp1(tp_runs, arch: str, size: int) -> None:
    model_dir, got = tp_runs(arch, size)
    reference = LLM(engine_config=_engine_config(str(model_dir)))
    expected = _greedy(reference)
    full_params = sum(p.numel() for p in reference.engine.model.parameters())
    assert all(len(ids) == NEW_TOKENS for ids in expected)
    for rank, (ids, params) in sorted(got.items()):
        assert ids == expected, f"{arch} TP={size}: rank {rank} decoded differently from TP=1"
        # Each rank holds its shard, not a full copy (norms and replicated KV heads aside).
        assert params < full_params * 0.75, f"rank {rank} holds {params} of {full_params} parameters"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_on_two_gpus_equals_tp1(tmp_path: Path, arch: str) -> None:
    """NCCL, fp32, Triton attention and CUDA graphs: TP=2 over two GPUs == TP=1 on one."""
    make_tiny_model(arch, tmp_path)
    reference = LLM(engine_config=_engine_config(str(tmp_path), device="cuda"))
    expected = _greedy(reference)
    assert reference.engine.device.type == "cuda" and reference.engine.attn_name == "triton"
    del reference
    torch.cuda.empty_cache()
    got = _run_tp(tmp_path, 2, device="cuda")
    for rank, (ids, _params) in sorted(got.items()):
        assert ids == expected, f"{arch} TP=2 on two GPUs: rank {rank} decoded differently from TP=1"
