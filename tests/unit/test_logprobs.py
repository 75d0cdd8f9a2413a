"""Logprobs of sampled tokens and of prompt tokens equal log_softmax of Hugging Face logits on a
tiny random model (fp32), whatever the batch, chunking, prefix cache, overlap or retraction."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.sampler import token_logprobs
from minisgl.scheduler.config import SchedulerConfig
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_lp")
    hf = make_tiny_model("llama", path)
    return str(path), hf


def _hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF logits at every position of `ids`: [len(ids), vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_entry(entry: dict, expected: torch.Tensor, token: int, k: int) -> None:
    """`entry`: vLLM's shape, token id -> Logprob; the top k carry their rank 1..k."""
    chosen = entry[token].logprob
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None)
    assert [rank for rank, _, _ in ranked] == list(range(1, k + 1))
    assert set(entry) - {t for _, t, _ in ranked} <= {token}  # nothing else but the chosen token
    top = [(t, value) for _, t, value in ranked]
    assert chosen == pytest.approx(float(expected[token]), abs=1e-4)
    assert len(top) == k
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True), "top-k not sorted"
    ref_values, ref_ids = expected.topk(k)
    assert [t for t, _ in top] == ref_ids.tolist()
    assert values == pytest.approx(ref_values.tolist(), abs=1e-4)


def test_token_logprobs_function() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    tokens = torch.tensor([0, 5, 39, 7, 7, 1])
    out = token_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.chosen, ref[torch.arange(6), tokens])
    torch.testing.assert_close(out.top_values, ref.sort(dim=-1, descending=True).values[:, :4])
    assert token_logprobs(logits, tokens, 0).top_ids.shape == (6, 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_token_logprobs_match_hf(tiny, overlap) -> None:
    model_dir, hf = tiny
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 30, 17, 4)]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # no logprobs in the same batch
        # Sampling with controls: still the raw model distribution (vLLM's default).
        SamplingParams(temperature=0.9, seed=3, max_tokens=7, ignore_eos=True, logprobs=20,
                       repetition_penalty=1.4, logit_bias={17: 3.0}),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),
    ]
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=256,
              scheduler_config=SchedulerConfig(max_prefill_tokens=16, overlap=overlap))
    results = llm.generate(prompts, params, use_tqdm=False)
    assert results[1].outputs[0].logprobs is None and results[1].prompt_logprobs is None
    assert results[1].outputs[0].cumulative_logprob is None
    for prompt, sp, res in zip(prompts, params, results):
        if sp.logprobs is None:
            continue
        out = res.outputs[0].token_ids
        logprobs = res.outputs[0].logprobs
        assert len(logprobs) == len(out) == sp.max_tokens
        expected = _hf_logprobs(hf, prompt + out)
        cumulative = sum(entry[token].logprob for token, entry in zip(out, logprobs))
        assert res.outputs[0].cumulative_logprob == pytest.approx(cumulative)
        for i, (token, entry) in enumerate(zip(out, logprobs)):
            _check_entry(entry, expected[len(prompt) - 1 + i], token, sp.logprobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_match_hf(tiny, overlap) -> None:
    """Chunked prefill (16-token budget), a prompt already in the prefix cache, and a 1-token prompt."""
    model_dir, hf = tiny
    rng = random.Random(2)
    shared = [rng.randrange(3, 512) for _ in range(41)]
    prompts = [shared, shared + [5, 6, 7], [rng.randrange(3, 512) for _ in range(23)], [42]]
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=256,
              scheduler_config=SchedulerConfig(max_prefill_tokens=16, overlap=overlap))
    llm.generate([shared], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # cache it
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k, logprobs=k % 2 or None)
              for k in (3, 0, 7, 2)]
    results = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, res in zip(prompts, params, results):
        plp = res.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt)
        assert plp[0] is None
        expected = _hf_logprobs(hf, prompt)
        for pos in range(1, len(prompt)):
            _check_entry(plp[pos], expected[pos - 1], prompt[pos], sp.prompt_logprobs)
    assert results[0].num_cached_tokens == 0  # every position needs its logits: no cache match
    llm.scheduler.check_idle_invariants()


def test_logprobs_survive_retraction(tiny) -> None:
    """A pool too small for the batch: requests are retracted and recomputed; every request still
    gets one logprob entry per token and its prompt logprobs exactly once."""
    model_dir, hf = tiny
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i % 2 else None) for i in range(8)]
    sched = SchedulerConfig(max_running_requests=8, max_prefill_tokens=16, decode_reserve_tokens=1, overlap=True)
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=40, scheduler_config=sched)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_retractions > 0, "the test must force preemption"
    for prompt, sp, res in zip(prompts, params, results):
        out = res.outputs[0]
        expected = _hf_logprobs(hf, prompt + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 24
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            _check_entry(entry, expected[len(prompt) - 1 + i], token, 2)
        if sp.prompt_logprobs is None:
            assert res.prompt_logprobs is None
        else:
            assert len(res.prompt_logprobs) == len(prompt) and res.prompt_logprobs[0] is None
            for pos in range(1, len(prompt)):
                _check_entry(res.prompt_logprobs[pos], expected[pos - 1], prompt[pos], 1)
