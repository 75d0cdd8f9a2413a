"""The CPU's `--dtype auto`: bf16 where the CPU has native bf16 (the suite pins fp32 for its
exactness checks through MINISGL_DEFAULT_DTYPE; here that pin is lifted), and the embedded model in
bf16 still answers like the fp32 one on a factual prompt and agrees with fp32 (which equals HF,
tests/golden/test_embedded_parity.py) up to the first divergence, where both tokens are in the
other's top-5."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.platform.cpu import CpuPlatform, cpu_has_native_bf16


def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert CpuPlatform().default_dtype == expected
    monkeypatch.setattr("minisgl.platform.cpu.cpu_has_native_bf16", lambda: False)
    assert CpuPlatform().default_dtype == torch.float32


def test_unknown_default_dtype_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl import env

    monkeypatch.setattr(env, "ENV", env.Env.read().__class__(**{**env.ENV.__dict__, "default_dtype": "float8"}))
    monkeypatch.setattr("minisgl.engine.engine.ENV", env.ENV)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(device="cpu")


def test_embedded_bf16_answers_and_tracks_fp32() -> None:
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    texts = ["The history of the printing press", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
    outs, runs = {}, {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(device="cpu", dtype=dtype)
        assert llm.engine.dtype == getattr(torch, dtype)
        outs[dtype] = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
        runs[dtype] = llm.generate(texts, params, use_tqdm=False)
        del llm
    assert "Paris" in outs["bfloat16"], outs
    assert "Paris" in outs["float32"], outs
    for low, full in zip(runs["bfloat16"], runs["float32"]):
        for i, (a, b) in enumerate(zip(low.outputs[0].token_ids, full.outputs[0].token_ids)):
            if a != b:
                top_low = [t for t, lp in low.outputs[0].logprobs[i].items() if lp.rank is not None]
                top_full = [t for t, lp in full.outputs[0].logprobs[i].items() if lp.rank is not None]
                assert b in top_low and a in top_full, (i, a, b, top_low, top_full)
                break
