"""Multi-LoRA: greedy output equal to Hugging Face PEFT token for token (fp32, CPU) on a tiny
random base with two random adapters written by PEFT's `save_pretrained`; a mixed batch
(adapter A, adapter B, base) equals each request alone; adapters never share prefix-cache KV."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.lora_adapters import ALL_TARGETS, make_adapter, peft_model
from tests.tiny_models import hf_greedy, make_tiny_model

NEW_TOKENS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 41)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model("qwen2", root / "base")  # GQA, q/k/v biases, 3 layers
    adapters = {"alpha": root / "alpha", "beta": root / "beta"}
    make_adapter(base, adapters["alpha"], rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    # rsLoRA, a lower rank than the engine's cap, and only some projections (k of qkv, up of gate_up absent)
    make_adapter(base, adapters["beta"], rank=4, alpha=6, targets=["q_proj", "v_proj", "gate_proj", "down_proj"],
                 seed=2, use_rslora=True)  # fmt: skip
    return root / "base", base, adapters


@pytest.fixture(scope="module")
def llm(tiny: tuple[Path, torch.nn.Module, dict[str, Path]]) -> LLM:
    path, _, adapters = tiny
    return LLM(str(path), device="cpu", page_size=4, num_pages=256, max_loras=2, max_lora_rank=8,
               lora_modules={name: str(p) for name, p in adapters.items()})  # fmt: skip


@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_greedy_matches_peft(tiny, llm: LLM, name: str) -> None:
    _, base, adapters = tiny
    reference = peft_model(base, adapters[name])
    prompts = _prompts(3)
    for prompt in prompts:
        expected = hf_greedy(reference, prompt, NEW_TOKENS)
        assert expected != hf_greedy(base, prompt, NEW_TOKENS), "the adapter must change the output"
        got = llm.generate(prompt, PARAMS, use_tqdm=False, lora=name)[0].outputs[0].token_ids
        assert got == expected, f"{name}, prompt of {len(prompt)} tokens"


def test_mixed_batch_equals_each_alone(tiny, llm: LLM) -> None:
    _, base, _ = tiny
    prompts = _prompts(5)
    names: list[str | None] = ["alpha", "beta", None, "beta", "alpha", None]
    batch = prompts + prompts[::-1]
    alone = [llm.generate(p, PARAMS, use_tqdm=False, lora=n)[0].outputs[0].token_ids for p, n in zip(batch, names)]
    mixed = [out.outputs[0].token_ids for out in llm.generate(batch, PARAMS, use_tqdm=False, lora=names)]
    assert mixed == alone
    assert alone[2] == hf_greedy(base, batch[2], NEW_TOKENS)  # the base rows stay the base model
    assert len({tuple(alone[i]) for i in (0, 2)}) == 2 and alone[0] != alone[4]  # different prompts and adapters


def test_prefix_cache_is_per_adapter(tiny, llm: LLM) -> None:
    """The same prompt under base, alpha, base, alpha: the second run of each hits the cache of
    its own namespace only, and every output equals the first of its adapter."""
    prompt = _prompts(9)[2]
    llm.scheduler.flush_cache()
    runs = [llm.generate(prompt, PARAMS, use_tqdm=False, lora=name)[0] for name in (None, "alpha", None, "alpha")]
    assert runs[0].num_cached_tokens == 0 and runs[1].num_cached_tokens == 0, "KV shared across adapters"
    assert runs[2].num_cached_tokens > 0 and runs[3].num_cached_tokens > 0
    assert runs[2].outputs[0].token_ids == runs[0].outputs[0].token_ids
    assert runs[3].outputs[0].token_ids == runs[1].outputs[0].token_ids != runs[0].outputs[0].token_ids


def test_more_adapters_than_slots_take_turns(tiny, llm: LLM, tmp_path: Path) -> None:
    """A third adapter, loaded at run time, with two slots: one batch of three adapters runs in
    turns (each request waits for a slot) and each equals PEFT's output."""
    _, base, adapters = tiny
    make_adapter(base, tmp_path / "gamma", rank=2, alpha=4, targets=["o_proj", "up_proj"], seed=3)
    llm.load_lora_adapter("gamma", str(tmp_path / "gamma"))
    try:
        prompt = _prompts(11)[1]
        names = ["alpha", "beta", "gamma"]
        outs = llm.generate([prompt] * 3, PARAMS, use_tqdm=False, lora=names)
        paths = {**adapters, "gamma": tmp_path / "gamma"}
        for name, out in zip(names, outs):
            assert out.outputs[0].token_ids == hf_greedy(peft_model(base, paths[name]), prompt, NEW_TOKENS), name
    finally:
        llm.unload_lora_adapter("gamma")
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(prompt, PARAMS, use_tqdm=False, lora="gamma")


def test_bad_adapters_are_refused(tiny, llm: LLM, tmp_path: Path) -> None:
    _, base, adapters = tiny
    make_adapter(base, tmp_path / "big", rank=16, alpha=16, targets=["q_proj"], seed=4)
    with pytest.raises(ValueError, match="greater than max_lora_rank 8"):
        llm.load_lora_adapter("big", str(tmp_path / "big"))
    with pytest.raises(ValueError, match="already been loaded"):
        llm.load_lora_adapter("alpha", str(adapters["alpha"]))
    with pytest.raises(ValueError, match="no LoRA adapter"):
        llm.load_lora_adapter("nowhere", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="cannot be found"):
        llm.unload_lora_adapter("nowhere")
    assert sorted(name for name, _ in llm.engine.lora.listed()) == ["alpha", "beta"]
