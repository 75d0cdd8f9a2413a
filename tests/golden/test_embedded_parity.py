"""The embedded SmolLM2-135M-Instruct: greedy output equals Hugging Face transformers token for
token (fp32, CPU) on chat-templated prompts, run live on the same weights."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three primes."}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", weights="float32")  # the exact mode (the CPU default keeps the GGUF's blocks)


@functools.cache
def embedded_greedy() -> tuple[str, list[int], list[list[int]], list[Any]]:
    """The embedded model in the exact mode (fp32), greedy, NEW_TOKENS tokens on CONVERSATIONS,
    once per test run: (its directory, its EOS ids, the templated prompts, the outputs). The HF
    parity below and tests/golden/test_speculative.py (speculation changes no token) compare with
    it; they asked the same engine the same thing, each on its own, before."""
    llm = LLM(device="cpu", weights="float32")
    try:
        prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
        ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        return str(llm.engine.model_dir), list(llm.engine.model_config.eos_ids), prompts, [r.outputs[0] for r in ours]
    finally:
        del llm


def test_embedded_greedy_matches_hf():
    from transformers import AutoModelForCausalLM

    model_dir, eos, prompts, ours = embedded_greedy()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])
        expected = out[0, len(prompt):].tolist()
        if expected and expected[-1] in eos:
            assert got.finish_reason == "stop"
        assert got.token_ids == expected


def test_embedded_answers_paris(llm):
    out = llm.chat([CONVERSATIONS[0]], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
