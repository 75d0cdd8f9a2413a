"""Tiny random-weight checkpoints that the server can run split over ranks: 4 attention heads,
2 key/value heads (so TP=2 splits them and TP=4 replicates them), with the embedded SmolLM2
tokenizer (hence the 49152-token vocabulary), so the server tokenizes and detokenizes as usual."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen3")


def make_served_model(arch: str, path: Path, seed: int = 0) -> Path:
    import torch
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if arch == "llama":
        config = tf.LlamaConfig(tie_word_embeddings=True, rope_theta=50000.0, **common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen3":
        config = tf.Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    cls(config).eval().save_pretrained(path)
    copy_embedded_tokenizer(path)
    return path


def copy_embedded_tokenizer(path: Path) -> None:
    """Give a tiny checkpoint the embedded SmolLM2 tokenizer (its vocabulary must be 49152)."""
    from minisgl.models.source import resolve_model_dir

    tokenizer_dir = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)


PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 8


def offline_answers(model_dir: Path) -> dict[str, Any]:
    """TP=1 greedy answers of the offline engine: the reference for every split."""
    from minisgl import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", num_pages=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    answers = {
        "completions": [r.outputs[0].text for r in outs],
        "completion_tokens": sum(len(r.outputs[0].token_ids) for r in outs),
        "chat": llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text,
    }
    assert all(answers["completions"]) and answers["chat"], answers  # a reference worth comparing with
    return answers


def openai_client(base_url: str) -> Any:
    import pytest

    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=180)


def check_openai_answers(base_url: str, expected: dict[str, Any]) -> None:
    """Completions (one batch of prompts), chat, and streamed chat equal the offline answers."""
    client = openai_client(base_url)
    completion = client.completions.create(model="m", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    texts = [choice.text for choice in sorted(completion.choices, key=lambda c: c.index)]
    assert texts == expected["completions"]
    assert completion.usage is not None and completion.usage.completion_tokens == expected["completion_tokens"]
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == expected["chat"]
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected["chat"]
