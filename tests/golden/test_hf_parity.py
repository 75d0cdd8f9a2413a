"""Greedy decoding and logits equal Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.tiny_models import ARCHS, hf_greedy, make_tiny_model

NEW_TOKENS = 48


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 23, 70)]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(request.param, path)
    return request.param, path, model


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf(tiny, page_size):
    arch, path, hf_model = tiny
    prompts = _prompts(hash(arch) % 1000)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(path), device="cpu", page_size=page_size, num_pages=1024 // page_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # All prompts in one batch (mixed lengths) and each alone must both equal HF.
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, exp, got in zip(prompts, expected, batched):
        assert got.outputs[0].token_ids == exp, f"{arch} batched, prompt len {len(prompt)}"
        assert got.outputs[0].finish_reason == "length"
    alone = llm.generate(prompts[2], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == expected[2]


def test_logits_match_hf(tiny):
    arch, path, hf_model = tiny
    prompt = _prompts(7)[3]
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=64)
    ours = _full_prefill_logits(llm, prompt)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"{arch}: max relative logits error {rel:.2e}"


def _full_prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    from tests.engine_helpers import forward_logits

    return forward_logits(llm.engine, [prompt], all_positions=True)[0]
