"""The batching scheduler changes nothing about greedy output: chunking, preemption, eviction and
prefix reuse all give the token ids of running each prompt alone."""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama", path)
    return str(path)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 120))] for _ in range(count)]


def _invariance_case() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = _prompts(24)
    max_tokens = [16 + (i * 7) % 40 for i in range(len(prompts))]
    return prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.fixture(scope="module")
def alone(model_dir) -> list[list[int]]:
    """Each prompt of the invariance case run by itself: the reference of both overlap settings."""
    prompts, params = _invariance_case()
    roomy = LLM(model_dir, device="cpu", page_size=4, num_pages=4096, max_running_requests=1)
    return [roomy.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_invariance_under_chunking_and_preemption(model_dir, alone, overlap):
    prompts, params = _invariance_case()

    # 48 pages of 4 tokens cannot hold 24 requests of up to ~160 tokens: admission stalls,
    # decodes retract requests and the prefix cache is evicted; a 16-token budget chunks prompts.
    # A 1-token decode reserve admits optimistically, so running requests must be retracted.
    sched = SchedulerConfig(max_running_requests=24, max_prefill_tokens=16, decode_reserve_tokens=1,
                            overlap=overlap)
    tight = LLM(model_dir, device="cpu", page_size=4, num_pages=48, scheduler_config=sched)
    batched = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_retractions > 0, "the test must force preemption"
    for i, (got, exp) in enumerate(zip(batched, alone)):
        assert got.outputs[0].token_ids == exp, f"prompt {i} differs"
        assert got.outputs[0].finish_reason == "length"
    tight.scheduler.check_idle_invariants()
    tight.scheduler.flush_cache()
    assert tight.scheduler.allocator.num_free == tight.scheduler.allocator.num_pages


def test_radix_prefix_reuse(model_dir):
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(200)]
    first = shared + [rng.randrange(3, 512) for _ in range(9)]
    second = shared + [rng.randrange(3, 512) for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = {}
    for cache in ("radix", "naive"):
        llm = LLM(model_dir, device="cpu", page_size=1, num_pages=2048, cache=cache)
        llm.generate([first], params, use_tqdm=False)
        results[cache] = llm.generate([second], params, use_tqdm=False)[0]
        llm.scheduler.check_idle_invariants()
    assert results["radix"].num_cached_tokens >= 200
    assert results["naive"].num_cached_tokens == 0
    assert results["radix"].outputs[0].token_ids == results["naive"].outputs[0].token_ids


def test_no_leak_after_aborts(model_dir):
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=256, max_prefill_tokens=32)
    sched = llm.scheduler
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for rid, prompt in enumerate(_prompts(8, seed=5)):
        sched.add_request(1000 + rid, prompt, params)
    for _ in range(3):
        sched.step()
    assert sched.abort(1000)  # running (or waiting) requests
    assert sched.abort(1007)
    assert not sched.abort(424242)
    while sched.has_work():
        sched.step()
    sched.check_idle_invariants()
    held = sched.allocator.num_free + sched.cache.cached_pages
    assert held == sched.allocator.num_pages
    sched.flush_cache()
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_bad_prompt_late_in_a_call_leaves_nothing_queued(model_dir):
    """generate() queues its prompts a slice at a time while the first steps run; a prompt that
    fails its check after others were queued (and some started) raises, and the requests queued
    before it are aborted: no request, page or row stays held, and the LLM keeps serving."""
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=256, max_prefill_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(12, seed=3)
    with pytest.raises(ValueError, match=r"token id 100000 is out of range \[0, "):  # the server's message
        llm.generate([*prompts, [5, 100_000]], params, use_tqdm=False)
    assert not llm.scheduler.has_work() and not llm.scheduler.reqs
    llm.scheduler.check_idle_invariants()
    again = llm.generate(prompts[:3], params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:3]]
    assert [r.outputs[0].token_ids for r in again] == alone
