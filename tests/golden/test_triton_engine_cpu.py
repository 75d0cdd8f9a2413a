"""The whole engine with `attn="triton"` on CPU (Triton interpreter) gives the greedy output of
`attn="torch"`: the GPU attention kernels run through the same scheduler, pages and tables."""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_backend(tmp_path, page_size):
    make_tiny_model("qwen3", tmp_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    for attn in ("torch", "triton"):
        llm = LLM(str(tmp_path), device="cpu", attn=attn, page_size=page_size, num_pages=512 // page_size,
                  max_prefill_tokens=32)
        results[attn] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert results["triton"] == results["torch"]
