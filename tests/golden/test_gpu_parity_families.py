"""GPU correctness of issue 22's families (tests/tiny_models.py FAMILY_ARCHS: Gemma 2, Gemma 3 as a
causal LM and inside a multimodal checkpoint, Phi-3, Granite, OLMo 2, Mistral with a window) on
the Triton backend with CUDA graphs: fp32 greedy equal to Hugging Face (parting only at a near-tie
within the 1e-4 relative logit tolerance, checked there), and bf16 up to the first divergence,
where both tokens sit in the other side's top-5. Every windowed model has a 16-token window;
prompts reach 130 tokens and decode 48 more, so prefill, chunked prefill (64-token chunks over the
cached prefix) and captured decode all run past it."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.tiny_models import FAMILY_ARCHS, hf_greedy, make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

NEW = 48


def _prompts(arch: str) -> list[list[int]]:
    """Prompt lengths 1-130; for Phi-3 those that stay within its original_max_position_embeddings
    (128) with the decoded tokens: the recompute past it (layers/rotary.py, as transformers'
    generate does) has its own tests, tests/golden/test_longrope.py."""
    rng = random.Random(22)
    lengths = (1, 9, 40, 130) if arch != "phi3" else (1, 9, 40, 128 - NEW)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_tiny_model(request.param, path)


@pytest.mark.parametrize("graph_bs", [16, 0])
def test_fp32_triton_equals_hf(tiny, graph_bs):
    arch, path, hf = tiny
    prompts = _prompts(arch)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = LLM(str(path), device="cuda", dtype="float32", attn="triton", page_size=16, num_pages=256,
              cuda_graph_max_bs=graph_bs, max_prefill_tokens=64)  # fmt: skip
    assert llm.engine.attn_name == "triton"
    for prompt, got, exp in zip(prompts, _greedy(llm, prompts), expected):
        if got != exp:
            _near_tie(llm, hf, prompt, got, exp, f"{arch} (graphs up to {graph_bs}), prompt len {len(prompt)}")


def _near_tie(llm: LLM, hf: torch.nn.Module, prompt: list[int], got: list[int], exp: list[int], what: str) -> None:
    """A GPU fp32 run against CPU fp32 transformers sums in another order, so greedy may part where
    transformers' two best logits are closer than the 1e-4 relative logit tolerance the CPU parity
    tests use (Gemma 2's 40-token prompt, token 44: a 1.4e-4 gap on logits near 1.7). The runs may
    part only there: our logits at that context equal transformers' within 1e-4 relative and the two
    chosen tokens are within that tolerance of each other in transformers' logits."""
    from tests.engine_helpers import forward_logits

    i = next(k for k, (a, b) in enumerate(zip(got, exp)) if a != b)
    context = prompt + exp[:i]
    with torch.no_grad():
        theirs = hf(torch.tensor([context])).logits[0, -1].float()
    ours = forward_logits(llm.engine, [context], first_page=200)[0][0].float().cpu()
    tol = 1e-4 * theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= tol, f"{what}: logits differ by more than 1e-4 relative at {i}"
    gap = (theirs[exp[i]] - theirs[got[i]]).item()
    assert gap <= tol, f"{what}: divergence at {i} ({got[i]} vs {exp[i]}) is no near-tie: gap {gap:.3e} > {tol:.3e}"


def test_bf16_top5_at_divergence(tiny):
    from tests.engine_helpers import check_top5_at_divergence

    arch, path, hf = tiny
    hf_cuda = copy.deepcopy(hf).to("cuda", torch.bfloat16)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", attn="triton", page_size=16, num_pages=256)
    check_top5_at_divergence(llm, hf_cuda, _prompts(arch), NEW, arch)
