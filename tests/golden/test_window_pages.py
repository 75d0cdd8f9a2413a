"""Models with a sliding window on every layer (Mistral v0.1-style, Phi-3-mini-4k-style) return
the pages behind the window to the pool while a request runs (`PageManager.slide`): on tiny
random weights (fp32, CPU, 16- and 24-token windows) three requests run side by side in a pool
that admits one at a time without it (the freed pages reused by the others at once), and
greedy stays equal to Hugging Face's token for token."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.tiny_models import hf_greedy, make_tiny_model

NEW_TOKENS = 32
PS = 4


# (arch, cache, prompt length, new tokens, pool pages, requests at once): radix keeps each prompt's
# pages (cache-owned while the request runs) and slides its decode only, hence short prompts and
# long decodes there. Without sliding, each of these pools runs one request at a time.
# The Triton backend (the interpreter on CPU) reads the same pages through its own kernels.
CASES = [
    ("mistral_sw", "naive", 70, 32, 48, 3, "torch"), ("mistral_sw", "radix", 24, 72, 40, 2, "torch"),
    ("phi3", "naive", 70, 32, 48, 3, "torch"), ("mistral_sw", "naive", 70, 24, 48, 3, "triton"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "cache", "prompt_len", "new_tokens", "pages", "side_by_side", "attn"), CASES)
def test_window_pages_go_back_and_greedy_matches_hf(
    tmp_path, arch: str, cache: str, prompt_len: int, new_tokens: int, pages: int, side_by_side: int, attn: str
) -> None:
    if attn == "triton":
        from minisgl.kernels.attention import is_interpreted

        if not torch.cuda.is_available() and not is_interpreted():
            pytest.skip("triton was imported in compiled mode before the interpreter could be selected")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_tiny_model(arch, tmp_path)
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(3)]
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", page_size=PS, num_pages=pages,
                  max_prefill_tokens=32, cache=cache, attn=attn)  # fmt: skip
        assert llm.engine.model_config.kv_window is not None
        # The scheduler driven step by step, to see how many requests it runs at once.
        sched = llm.scheduler
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for rid, prompt in enumerate(prompts):
            sched.add_request(rid, prompt, params)
        tokens: dict[int, list[int]] = {rid: [] for rid in range(len(prompts))}
        most = 0
        while sched.has_work():
            for out in sched.step():
                tokens[out.rid] += out.token_ids
            most = max(most, len(sched.running))
        assert most >= side_by_side, f"at most {most} requests at once"
        assert sched.num_retractions == 0
        for rid, prompt in enumerate(prompts):
            assert tokens[rid] == hf_greedy(model, prompt, new_tokens), f"request {rid}"
    finally:
        torch.set_num_threads(threads)
