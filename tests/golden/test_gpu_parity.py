"""GPU correctness: tiny random models equal Hugging Face (fp32 exactly; bf16 up to the first
divergence, where both tokens sit in the other side's top-5), with the Triton backend and CUDA
graphs; graphs on/off give identical output."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.tiny_models import ARCHS, hf_greedy, make_tiny_model  # noqa: F401

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

NEW = 48


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 40, 130)]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, make_tiny_model(request.param, path)


@pytest.mark.parametrize("attn,graph_bs", [("triton", 16), ("triton", 0), ("torch", 0)])
def test_fp32_equals_hf(tiny, attn, graph_bs):
    path, hf = tiny
    prompts = _prompts()
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = LLM(str(path), device="cuda", dtype="float32", attn=attn, page_size=16, num_pages=256,
              cuda_graph_max_bs=graph_bs)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    for g, e in zip(got, expected):
        assert g.outputs[0].token_ids == e


def test_bf16_top5_at_divergence(tiny):
    path, hf = tiny
    hf_cuda = copy.deepcopy(hf).to("cuda", torch.bfloat16)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", page_size=16, num_pages=256)
    for prompt in _prompts():
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        theirs = _hf_greedy_cuda(hf_cuda, prompt)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a == b:
                continue
            context = prompt + ours[:i]
            with torch.no_grad():
                hf_top = hf_cuda(torch.tensor([context], device="cuda")).logits[0, -1].topk(5).indices.tolist()
            from tests.engine_helpers import forward_logits

            our_top = forward_logits(llm.engine, [context], first_page=200)[0][0].topk(5).indices.tolist()
            assert a in hf_top and b in our_top, f"divergence at {i}: {a} vs {b}"
            break


def _hf_greedy_cuda(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
