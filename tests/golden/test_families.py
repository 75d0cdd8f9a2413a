"""Issue 22's families equal Hugging Face transformers on the same tiny random weights (fp32,
CPU): Gemma 2 (soft-caps, GeGLU, four (1 + w) norms, scaled embedding), Gemma 3 (q/k norms,
sliding:global pattern, local/global rope bases) as a causal LM and inside a multimodal
checkpoint, Phi-3 (fused qkv/gate_up, LongRoPE crossing into its long factors, partial rotary),
Granite (four multipliers), OLMo 2 (post norms, whole-projection q/k norm) and Mistral with a
sliding window. Every windowed model has a 16-token window, so prompts, chunked prefill over a
cached prefix, and a prefix-cached second request all run past it."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.tiny_models import FAMILY_ARCHS, WINDOW, hf_greedy, make_tiny_model

NEW_TOKENS = 32


def _token_ids(out: Any) -> list[int]:
    """A generate() result's token ids: a dict today, a vLLM-shaped RequestOutput later."""
    return list(out["token_ids"]) if isinstance(out, dict) else list(out.outputs[0].token_ids)


def _cached_tokens(out: Any) -> int:
    return int(out["cached_tokens"]) if isinstance(out, dict) else int(out.num_cached_tokens)


def _prompts(seed: int, lengths: tuple[int, ...] = (1, 9, 23, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def tiny(request, tmp_path_factory):
    # One thread: at these sizes a second one only adds synchronisation (16 ms per GEMM instead
    # of 0.02 on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(request.param, path)
    # Chunked prefill (16-token chunks): the 70-token prompt extends three times over its own
    # cached prefix, each chunk's window reaching back into the previous one.
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=512, max_prefill_tokens=16)
    yield request.param, model, llm
    torch.set_num_threads(threads)


def _greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def test_greedy_matches_hf(tiny):
    arch, hf_model, llm = tiny
    prompts = _prompts(len(arch))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert len(set(expected[3])) > NEW_TOKENS // 4, f"{arch}: the tiny model collapsed into repeats"
    batched = _greedy(llm, prompts, NEW_TOKENS)
    for prompt, exp, got in zip(prompts, expected, batched):
        assert _token_ids(got) == exp, f"{arch} batched, prompt len {len(prompt)}"


def test_prefix_cached_continuation_crosses_window(tiny):
    """A second request sharing the first one's 36-token prompt (past the window) reuses its
    pages from the radix cache and extends over them; its tokens still equal HF's."""
    arch, hf_model, llm = tiny
    first, extra = _prompts(100 + len(arch), (36, 21))
    _greedy(llm, [first], 4)
    second = first + extra
    (out,) = _greedy(llm, [second], NEW_TOKENS)
    assert _cached_tokens(out) >= WINDOW + 4, f"{arch}: the shared prefix was not reused from the cache"
    assert _token_ids(out) == hf_greedy(hf_model, second, NEW_TOKENS), f"{arch}: continuation over the cache"


@pytest.mark.parametrize("prefix_len", [0, 45])
def test_logits_match_hf(tiny, prefix_len):
    """One forward's logits (every position), whole or extending a cached 45-token prefix."""
    from tests.engine_helpers import forward_logits

    arch, hf_model, llm = tiny
    prompt = _prompts(7, (70,))[0]
    ours = forward_logits(llm.engine, [prompt], prefix_lens=[prefix_len], all_positions=True)[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0, prefix_len:]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"{arch}: max relative logits error {rel:.2e}"
