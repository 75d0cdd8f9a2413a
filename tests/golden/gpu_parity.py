"""What the GPU parity tests (tests/golden/test_gpu_parity*.py) share: tiny models saved once per
module, prompts of 1 to 130 tokens decoding 48 more, the engine as those tests run it (the Triton
backend on 16-token pages), and the fp32 check (greedy equal to Hugging Face's, token for token,
or parting only where the test's `near_tie` accepts it). The bf16 check is
`tests.engine_helpers.check_top5_at_divergence`. Nothing here needs CUDA: the CPU test
tests/golden/test_gpu_parity_cpu.py runs these helpers on the CPU engine."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.tiny_models import hf_greedy

NEW = 48  # tokens decoded per prompt: the 130-token prompt runs past 128 + 48 positions
LENGTHS = (1, 9, 40, 130)
# (llm, hf, prompt, ours, theirs, what): asserts that an fp32 divergence is an accepted near-tie.
NearTie = Callable[[LLM, torch.nn.Module, list[int], list[int], list[int], str], None]


def parity_prompts(seed: int, vocab: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    """Random prompts of `lengths` tokens over ids 3..vocab-1 (clear of the tiny models' specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy_ids(llm: LLM, prompts: list[list[int]], new_tokens: int = NEW) -> list[list[int]]:
    """The engine's greedy tokens for each prompt, all prompts in one `generate` (batched)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


def tiny_models(variants: tuple[str, ...], make: Callable[[str, Path], torch.nn.Module]) -> Any:
    """A module-scoped fixture over `variants`: (variant, checkpoint dir, the HF model `make` saved there)."""

    @pytest.fixture(scope="module", params=variants)
    def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
        path = tmp_path_factory.mktemp(request.param)
        return request.param, path, make(request.param, path)

    return tiny


def parity_llm(path: Path, dtype: str, attn: str | None = "triton", device: str = "cuda", **options: Any) -> LLM:
    """The engine as the GPU parity tests run it: `attn` (None: the platform's default) on 256
    pages of 16 tokens."""
    return LLM(str(path), device=device, dtype=dtype, attn=attn, page_size=16, num_pages=256, **options)


def fp32_graph_llm(path: Path, graph_bs: int, device: str = "cuda") -> LLM:
    """fp32 on the Triton backend with decode graphs up to `graph_bs` (0: eager) and 64-token
    prefill chunks, so the 130-token prompt extends twice over its own cached prefix."""
    return parity_llm(path, "float32", device=device, cuda_graph_max_bs=graph_bs, max_prefill_tokens=64)


def bf16_on_gpu(hf: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of the fp32 reference on the GPU, for `check_top5_at_divergence`."""
    return copy.deepcopy(hf).to("cuda", torch.bfloat16)


def check_greedy_equals_hf(
    llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], what: str, near_tie: NearTie | None = None,
    new_tokens: int = NEW,
) -> list[list[int]]:  # fmt: skip
    """fp32 parity: each prompt's greedy tokens (all prompts in one batch) equal `hf`'s; where
    `near_tie` is given, a divergence is handed to it (it asserts that it is a near-tie).
    Returns transformers' tokens."""
    expected = [hf_greedy(hf, prompt, new_tokens) for prompt in prompts]
    for prompt, got, exp in zip(prompts, greedy_ids(llm, prompts, new_tokens), expected):
        if got == exp:
            continue
        label = f"{what}, prompt len {len(prompt)}"
        assert near_tie is not None, f"{label}: {got} != transformers' {exp}"
        near_tie(llm, hf, prompt, got, exp, label)
    return expected
