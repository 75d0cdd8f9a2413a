"""GPU correctness: tiny random models equal Hugging Face (fp32 exactly; bf16 up to the first
divergence, where both tokens sit in the other side's top-5), with the Triton backend and CUDA
graphs; graphs on/off give identical output (tests/golden/gpu_parity.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import check_top5_at_divergence
from tests.golden.gpu_parity import NEW, bf16_on_gpu, check_greedy_equals_hf, parity_llm, parity_prompts, tiny_models
from tests.tiny_models import ARCHS, make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _prompts() -> list[list[int]]:
    return parity_prompts(11, 512)


tiny = tiny_models(ARCHS, make_tiny_model)


@pytest.mark.parametrize("attn,graph_bs", [("triton", 16), ("triton", 0), ("torch", 0)])
def test_fp32_equals_hf(tiny, attn, graph_bs):
    arch, path, hf = tiny
    llm = parity_llm(path, "float32", attn, cuda_graph_max_bs=graph_bs)
    check_greedy_equals_hf(llm, hf, _prompts(), f"{arch}, {attn} (graphs up to {graph_bs})")


def test_bf16_top5_at_divergence(tiny):
    arch, path, hf = tiny
    llm = parity_llm(path, "bfloat16", attn=None)
    check_top5_at_divergence(llm, bf16_on_gpu(hf), _prompts(), NEW, arch)
