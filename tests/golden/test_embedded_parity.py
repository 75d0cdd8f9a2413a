"""The embedded SmolLM2-135M-Instruct: greedy output equals Hugging Face transformers token for
token (fp32, CPU) on chat-templated prompts, run live on the same weights."""

from __future__ import annotations

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


def test_embedded_greedy_matches_hf(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32).eval()
    eos = list(llm.engine.model_config.eos_ids)
    prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])
        expected = out[0, len(prompt):].tolist()
        if expected and expected[-1] in eos:
            assert got.outputs[0].finish_reason == "stop"
        assert got.outputs[0].token_ids == expected


def test_embedded_answers_paris(llm):
    out = llm.chat([CONVERSATIONS[0]], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
