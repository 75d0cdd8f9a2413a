"""Sampling controls end to end on a tiny random model (fp32): penalties, logit_bias and min_tokens
give the tokens of a per-request reference run on Hugging Face logits, each request's result is
the same alone and inside a batch of requests with other controls, and n > 1 copies of a prompt
submitted together compute it once. With and without overlap scheduling."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from tests.tiny_models import make_tiny_model

EOS = 2  # the tiny models' eos_token_id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_controls")
    hf = make_tiny_model("llama", path)
    return str(path), hf


def _llm(model_dir: str, overlap: bool, **sched: object) -> LLM:
    config = SchedulerConfig(overlap=overlap, max_prefill_tokens=32, **sched)  # type: ignore[arg-type]
    return LLM(model_dir, device="cpu", page_size=4, num_pages=512, scheduler_config=config)


def controlled_ref(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams) -> torch.Tensor:
    """The documented semantics, one request, written out plainly: logit_bias, then penalties
    (repetition over prompt + output, frequency and presence over output), then min_tokens."""
    out = logits.clone()
    for token, bias in sp.logit_bias.items():
        out[token] += bias
    seen = set(prompt) | set(output)
    for token in range(out.shape[0]):
        value = float(out[token])
        if token in seen:
            value = value / sp.repetition_penalty if value > 0 else value * sp.repetition_penalty
        count = output.count(token)
        value -= sp.frequency_penalty * count
        value -= sp.presence_penalty * (count > 0)
        out[token] = value
    if len(output) < sp.min_tokens:
        for token in set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS}):
            out[token] = float("-inf")
    return out


def hf_greedy_controlled(hf: torch.nn.Module, prompt: list[int], sp: SamplingParams) -> list[int]:
    output: list[int] = []
    with torch.no_grad():
        while len(output) < sp.max_tokens:
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
            token = int(controlled_ref(logits, prompt, output, sp).argmax())
            output.append(token)
            if (token == EOS and not sp.ignore_eos) or token in sp.stop_token_ids:
                break
    return output


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


GREEDY_CASES = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=2.0, repetition_penalty=0.8),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={7: 6.0, 300: -100.0}),
    SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 30.0}, min_tokens=6),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[9], logit_bias={9: 30.0},
                   min_tokens=3, frequency_penalty=-0.5),
]


@pytest.mark.parametrize("overlap", [False, True])
def test_controls_match_reference(tiny, overlap) -> None:
    model_dir, hf = tiny
    prompts = _prompts(len(GREEDY_CASES), seed=1)
    # Every control shares the batch with the others (and with a plain request).
    results = _llm(model_dir, overlap).generate(prompts, GREEDY_CASES, use_tqdm=False)
    plain = _llm(model_dir, overlap).generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                              use_tqdm=False)
    changed = 0
    for i, (prompt, sp, res) in enumerate(zip(prompts, GREEDY_CASES, results)):
        assert res.outputs[0].token_ids == hf_greedy_controlled(hf, prompt, sp), f"case {i}"
        changed += res.outputs[0].token_ids != plain[i].outputs[0].token_ids
    assert changed == len(GREEDY_CASES) - 1, "every control should change this model's greedy output"
    # min_tokens holds back the (strongly biased) EOS and stop token until it is reached.
    assert results[5].outputs[0].token_ids[-1] == EOS and len(results[5].outputs[0].token_ids) == 7
    assert results[5].outputs[0].finish_reason == "stop"
    assert results[6].outputs[0].token_ids[-1] == 9 and len(results[6].outputs[0].token_ids) == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_request_same_alone_and_in_batch(tiny, overlap) -> None:
    model_dir, _ = tiny
    prompts = _prompts(6, seed=2)
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, seed=12, max_tokens=12, ignore_eos=True, frequency_penalty=0.7, top_k=40),
        SamplingParams(temperature=0.7, seed=13, max_tokens=14, ignore_eos=True, presence_penalty=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, seed=14, max_tokens=10, logit_bias={EOS: 4.0}, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logit_bias={5: 3.0}),
        SamplingParams(temperature=1.0, seed=15, max_tokens=11, ignore_eos=True),
    ]
    llm = _llm(model_dir, overlap)
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in together] == alone
    assert len(alone[3]) >= 5 and EOS not in alone[3][:5]


@pytest.mark.parametrize("overlap", [False, True])
def test_logit_bias_forces_a_token(tiny, overlap) -> None:
    model_dir, _ = tiny
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logit_bias={123: 100.0}),
              SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)]
    results = _llm(model_dir, overlap).generate(_prompts(2, seed=3), params, use_tqdm=False)
    assert results[0].outputs[0].token_ids == [123] * 8
    assert results[1].outputs[0].token_ids != [123] * 8


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [8192, 16])
def test_identical_prompts_prefill_once(tiny, overlap, budget) -> None:
    """n = 4 copies submitted together: one computes the prompt, the others wait for it to reach
    the prefix cache and compute only the last partial page (with a small budget the prompt is
    chunked, and they wait for every chunk)."""
    model_dir, _ = tiny
    prompt = _prompts(1, seed=4)[0] + list(range(3, 40))  # 40+ tokens: several 4-token pages
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    page = 4
    results = {}
    for dedupe in (True, False):
        llm = LLM(model_dir, device="cpu", page_size=page, num_pages=512, scheduler_config=SchedulerConfig(
            overlap=overlap, max_prefill_tokens=budget, dedupe_prefill=dedupe))
        results[dedupe] = llm.generate([prompt] * 4, params, use_tqdm=False)
        llm.scheduler.check_idle_invariants()
    shared = (len(prompt) - 1) // page * page
    computed = sum(len(prompt) - r.num_cached_tokens for r in results[True])
    assert [r.num_cached_tokens for r in results[True]] == [0, shared, shared, shared]
    assert computed == len(prompt) + 3 * (len(prompt) - shared) and len(prompt) - shared <= page
    if budget > len(prompt) * 4:
        assert [r.num_cached_tokens for r in results[False]] == [0, 0, 0, 0]  # all computed it
    assert all(r.outputs[0].token_ids == results[False][0].outputs[0].token_ids for r in results[True] + results[False])
