"""Engine-level invariants on a tiny random model: cached-prefix extend, mixed batches, page sizes."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from tests.engine_helpers import forward_logits
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model("qwen3", path)
    return str(path)


def _engine(model_dir: str, page_size: int) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cpu", page_size=page_size, num_pages=2048 // page_size,
                               max_running_requests=8))


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(512) for _ in range(n)] for n in (37, 5, 64, 1, 20)]


def test_prefix_extend_equals_full_prefill(model_dir):
    engine = _engine(model_dir, 4)
    prompts = _prompts()
    full = forward_logits(engine, prompts, all_positions=True)
    prefix_lens = [30, 2, 33, 0, 19]
    split = forward_logits(engine, prompts, prefix_lens=prefix_lens, all_positions=True, first_page=200)
    for f, s, n in zip(full, split, prefix_lens):
        torch.testing.assert_close(s, f[n:], rtol=1e-5, atol=1e-5)


def test_mixed_batch_equals_alone(model_dir):
    engine = _engine(model_dir, 16)
    prompts = _prompts()
    together = forward_logits(engine, prompts)
    for i, prompt in enumerate(prompts):
        alone = forward_logits(engine, [prompt], first_page=100)
        torch.testing.assert_close(together[i], alone[0], rtol=1e-5, atol=1e-5)


def test_page_sizes_agree(model_dir):
    prompts = _prompts()
    one = forward_logits(_engine(model_dir, 1), prompts, all_positions=True)
    sixteen = forward_logits(_engine(model_dir, 16), prompts, all_positions=True)
    for a, b in zip(one, sixteen):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_batch_matches_extend(model_dir):
    """A decode step over several requests equals computing those tokens in a prefill."""
    from minisgl import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=256, max_running_requests=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts()
    outs = llm.generate(prompts, params, use_tqdm=False)
    # Re-prefill prompt + all but the last generated token; its next-token argmax must be the last one.
    full = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]
    logits = forward_logits(llm.engine, full, first_page=100)
    for lg, out in zip(logits, outs):
        assert int(lg.argmax()) == out.outputs[0].token_ids[-1]
