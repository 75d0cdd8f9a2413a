"""GPU correctness of GPT-OSS (tests/golden/test_gpt_oss.py's tiny model, 8-token window) on the
Triton backend (sink kernels) with the fused Triton experts and CUDA graphs: fp32 greedy equal to
Hugging Face, and bf16 up to the first divergence, where both tokens sit in the other side's
top-5. Prompts reach 130 tokens and decode 48 more, so prefill, chunked prefill (64-token chunks
over the cached prefix) and captured decode all run far past the window. Last, GPT-OSS-20B's
shipped config with dummy weights starts, captures its graphs and decodes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.engine_helpers import check_top5_at_divergence
from tests.golden.gpu_parity import (
    NEW,
    bf16_on_gpu,
    check_greedy_equals_hf,
    fp32_graph_llm,
    greedy_ids,
    parity_llm,
    parity_prompts,
)
from tests.golden.test_gpt_oss import VOCAB, make_mxfp4_gpt_oss, make_tiny_gpt_oss

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _prompts() -> list[list[int]]:
    return parity_prompts(26, VOCAB)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_tiny_gpt_oss(path)


def _check_kernels(llm: LLM) -> None:
    experts = [m for m in llm.engine.model.modules() if type(m).__name__ == "SwigluExperts"]
    assert experts and all(m.impl == "triton" for m in experts), "the fused Triton experts should serve on CUDA"
    assert llm.engine.attn_name == "triton"


@pytest.mark.parametrize("graph_bs", [16, 0])
def test_fp32_triton_equals_hf(tiny: tuple[Path, torch.nn.Module], graph_bs: int) -> None:
    path, hf = tiny
    prompts = _prompts()
    llm = fp32_graph_llm(path, graph_bs)
    _check_kernels(llm)
    expected = check_greedy_equals_hf(llm, hf, prompts, f"graphs up to {graph_bs}")
    batched = greedy_ids(llm, prompts)  # all four at once: mixed extend + decode steps
    assert batched == expected


def test_bf16_top5_at_divergence(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf = tiny
    llm = parity_llm(path, "bfloat16")
    _check_kernels(llm)
    check_top5_at_divergence(llm, bf16_on_gpu(hf), _prompts(), NEW, "GPT-OSS")


@pytest.mark.parametrize("graph_bs", [16, 0])
def test_fp32_mxfp4_resident_equals_hf(tmp_path: Path, graph_bs: int) -> None:
    """An MXFP4 checkpoint on CUDA keeps its experts 4-bit (the fused kernel dequantizes tiles
    exactly): fp32 greedy still equals HF on the dequantized weights."""
    hf = make_mxfp4_gpt_oss(tmp_path)
    llm = fp32_graph_llm(tmp_path, graph_bs)
    _check_kernels(llm)
    experts = [m for m in llm.engine.model.modules() if type(m).__name__ == "SwigluExperts"]
    assert all(m.mxfp4 for m in experts), "MXFP4 experts should stay 4-bit on CUDA"
    check_greedy_equals_hf(llm, hf, _prompts(), f"MXFP4 resident, graphs up to {graph_bs}")


@pytest.mark.slow
def test_gpt_oss_20b_dummy_weights_serve() -> None:
    """The shipped 20B config (24 layers, 32 experts top-4, 64 q / 8 KV heads, window 128, MXFP4
    experts kept 4-bit: ~14 GB) with dummy weights in bf16: loads, captures decode graphs, decodes
    past the window, and its logits are finite."""
    from tests.engine_helpers import forward_logits

    root = Path(__file__).resolve().parents[2]
    llm = LLM(str(root / "configs" / "gpt-oss-20b"), device="cuda", dtype="bfloat16", dummy_weights=True,
              page_size=16, num_pages=512, max_model_len=4096, cuda_graph_max_bs=8)  # fmt: skip
    _check_kernels(llm)
    assert all(m.mxfp4 for m in llm.engine.model.modules() if type(m).__name__ == "SwigluExperts")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200_000) for _ in range(n)] for n in (7, 300)]
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        ids = list(out.outputs[0].token_ids)
        assert len(ids) == 160 and all(0 <= t < 201_088 for t in ids)
    logits = forward_logits(llm.engine, [prompts[1]], first_page=400)[0]
    assert torch.isfinite(logits).all()
