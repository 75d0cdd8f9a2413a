"""The GPU parity tests' helpers (tests/golden/gpu_parity.py) on the CPU engine, so they are
exercised where there is no GPU: the GPU case's prompts (1-130 tokens, 48 decoded), pages and
64-token chunks with the torch backend equal transformers, and the fp32 check fails on a model
that decodes differently, handing each divergence to the near-tie rule when one is given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM
from tests.golden.gpu_parity import NEW, check_greedy_equals_hf, greedy_ids, parity_llm, parity_prompts, tiny_models
from tests.tiny_models import make_tiny_model

tiny = tiny_models(("llama",), make_tiny_model)


@pytest.fixture(scope="module")
def cpu_llm(tiny: tuple[str, Path, torch.nn.Module]) -> LLM:
    _, path, _ = tiny
    return parity_llm(path, "float32", attn="torch", device="cpu", max_prefill_tokens=64)


def test_gpu_case_on_cpu_equals_hf(tiny: tuple[str, Path, torch.nn.Module], cpu_llm: LLM) -> None:
    arch, _, hf = tiny
    prompts = parity_prompts(11, 512)
    assert [len(p) for p in prompts] == [1, 9, 40, 130] and all(3 <= t < 512 for p in prompts for t in p)
    expected = check_greedy_equals_hf(cpu_llm, hf, prompts, arch)
    assert all(len(ids) == NEW for ids in expected) and expected == greedy_ids(cpu_llm, prompts)


def test_fp32_check_fails_on_another_model(tmp_path: Path, cpu_llm: LLM) -> None:
    other = make_tiny_model("llama", tmp_path, seed=1)  # other weights: other tokens
    prompts = parity_prompts(5, 512, (9, 40))
    with pytest.raises(AssertionError, match="prompt len 9"):
        check_greedy_equals_hf(cpu_llm, other, prompts, "llama", new_tokens=8)
    seen: list[tuple[int, int]] = []

    def near_tie(llm: LLM, hf: torch.nn.Module, prompt: list[int], got: list[int], exp: list[int], what: str) -> None:
        assert llm is cpu_llm and hf is other and got != exp and what.startswith("llama, prompt len")
        seen.append((len(prompt), len(got)))

    check_greedy_equals_hf(cpu_llm, other, prompts, "llama", near_tie=near_tie, new_tokens=8)
    assert seen == [(9, 8), (40, 8)]
