"""The CPU's `--dtype auto`: bf16 where the CPU has native bf16 (the suite pins fp32 for its
exactness checks, tests/conftest.py; here that pin is lifted), and the embedded model in
bf16 still answers like the fp32 one on a factual prompt and agrees with fp32 (which equals HF,
tests/golden/test_embedded_parity.py) up to the first divergence, where both tokens are in the
other's top-5."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.resolve import resolve
from minisgl.platform.cpu import CpuPlatform


# `--dtype auto` decides for a dense checkpoint (a GGUF keeps its blocks on CPU with fp32
# activations, `--weights gguf`: tests/unit/test_weights_config.py).
DENSE = "/models/a-hugging-face-dir"


def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, native_cpu_dtype: torch.dtype) -> None:
    assert CpuPlatform().default_dtype == native_cpu_dtype
    assert resolve(EngineConfig(model=DENSE, device="cpu"), CpuPlatform()).dtype == str(native_cpu_dtype).removeprefix("torch.")
    assert resolve(EngineConfig(device="cpu"), CpuPlatform()).weights == "gguf"
    monkeypatch.setattr("minisgl.platform.cpu.cpu_has_native_bf16", lambda: False)
    assert CpuPlatform().default_dtype == torch.float32
    assert resolve(EngineConfig(model=DENSE, device="cpu"), CpuPlatform()).dtype == "float32"


def test_unknown_dtype_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        EngineConfig(dtype="float8")  # type: ignore[arg-type]


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
