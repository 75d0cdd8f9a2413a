"""The engine with `attn="triton"` on CPU (Triton interpreter) on the sliding-window and
soft-capped families: Gemma 2 (every other layer windowed, soft-capped scores), Gemma 3 (local and
global layers) and Mistral with a window on every layer greedy-decode Hugging Face's tokens, with
prompts past the 16-token window, prefill chunked over its own cached prefix, and a prefix-cached
continuation; the whole context is served (no cap at the window)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.models.config import ModelConfig
from tests.tiny_models import WINDOW, hf_greedy, make_tiny_model

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    from minisgl.kernels.attention import is_interpreted

    if not torch.cuda.is_available() and not is_interpreted():
        pytest.skip("triton was imported in compiled mode before the interpreter could be selected")


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral_sw", "phi3"])
def test_triton_backend_greedy_matches_hf_past_the_window(tmp_path, arch: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf_model = make_tiny_model(arch, tmp_path)
        # 16-token prefill chunks: the 40-token prompt extends twice over its own cached prefix.
        llm = LLM(str(tmp_path), device="cpu", attn="triton", page_size=4, num_pages=256, max_prefill_tokens=16)
        assert llm.engine.model_config.sliding_window == (WINDOW + 8 if arch == "phi3" else WINDOW)
        prompts = _prompts(len(arch), (5, 40))
        got = _greedy(llm, prompts, NEW_TOKENS)
        for prompt, ids in zip(prompts, got):
            assert ids == hf_greedy(hf_model, prompt, NEW_TOKENS), f"{arch}, prompt len {len(prompt)}"
        # A second request over the first prompt's cached pages (past the window) plus 9 new tokens.
        second = prompts[1] + _prompts(99, (9,))[0]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        (out,) = llm.generate([second], params, use_tqdm=False)
        assert out.num_cached_tokens >= WINDOW + 4, f"{arch}: the shared prefix was not reused from the cache"
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, second, NEW_TOKENS), f"{arch}: over the cache"
    finally:
        torch.set_num_threads(threads)


def test_triton_backend_serves_the_whole_context_of_a_window_model(tmp_path) -> None:
    """Mistral-style (every layer windowed): the window no longer caps the served context, on
    either backend."""
    make_tiny_model("mistral_sw", tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    assert config.sliding_window == WINDOW and config.context_len > WINDOW
    for attn in ("triton", "torch"):
        llm = LLM(str(tmp_path), device="cpu", attn=attn, page_size=4, num_pages=64)
        assert llm.engine.context_len == config.context_len, attn
        assert llm.engine.model_config.sliding_window == WINDOW, attn


def test_triton_backend_takes_soft_capped_local_global_layers(tmp_path) -> None:
    """Gemma 2 (local and global layers, soft-capped scores) binds on the Triton backend: each
    layer's spec reaches it."""
    make_tiny_model("gemma2", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", attn="triton", page_size=4, num_pages=64)
    specs = llm.engine.attn_backend.specs
    config = llm.engine.model_config
    assert {i: s.sliding_window for i, s in specs.items()} == {i: config.layer_window(i) for i in range(config.num_layers)}
    assert all(s.logit_cap == config.attn_logit_softcap for s in specs.values())
