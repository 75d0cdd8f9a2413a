"""The scheduler's LongRoPE rules (`Req.long_rope`) against the model-free fake engine, which
checks every step's pages and that each request reads exactly its own tokens.

With an original context of 8: a prompt past it is marked long from the start and shares no KV
through the prefix cache (never matched in, never inserted); a short sequence that grows past it
is computed again from position 0 (as Hugging Face's Phi-3 `generate` drops its cache there),
its short-factor pages left in the cache for other short prompts."""

from __future__ import annotations

import pytest

from minisgl.core import SamplingParams
from minisgl.message.tokenizer import TokenOut
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from tests.unit.fake_engine import FakeEngine, FakeModelConfig, check_scheduler_state, expected_output

ORIGINAL = 8
CONTEXT = 256


def _scheduler(overlap: bool = False, original: int | None = ORIGINAL) -> Scheduler:
    engine = FakeEngine(page_size=4, num_pages=128, context_len=CONTEXT)
    engine.model_config = FakeModelConfig((), 1000, long_rope_from=original)
    config = SchedulerConfig(max_running_requests=4, max_prefill_tokens=64, overlap=overlap)
    return Scheduler(engine, config)


def _run(sched: Scheduler, reqs: dict[int, list[int]], max_tokens: int) -> dict[int, list[TokenOut]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in reqs.items():
        sched.add_request(rid, prompt, params)
    outs: dict[int, list[TokenOut]] = {rid: [] for rid in reqs}
    for _ in range(200):
        if not sched.has_work():
            break
        for out in sched.step():
            outs[out.rid].append(out)
        check_scheduler_state(sched)
    assert not sched.has_work()
    engine = sched.engine
    for rid, prompt in reqs.items():
        expected, _ = expected_output(prompt, params, engine.next_token, (), CONTEXT)  # type: ignore[attr-defined]
        assert [t for out in outs[rid] for t in out.token_ids] == expected, f"rid {rid}"
    return outs


def test_a_prompt_past_the_original_context_shares_no_kv() -> None:
    sched = _scheduler()
    prompt = list(range(10, 30))  # 20 tokens > 8
    _run(sched, {0: prompt}, 4)
    assert sched.cache.cached_pages == 0, "a long prompt's KV went into the prefix cache"
    outs = _run(sched, {1: prompt + [5], 2: prompt[:6]}, 2)
    assert outs[1][0].cached_tokens == 0 and outs[2][0].cached_tokens == 0
    assert sched.num_retractions == 0


def test_short_prompts_share_as_before() -> None:
    sched = _scheduler()
    prompt = list(range(40, 47))  # 7 tokens: within the original context, ends at 8
    _run(sched, {0: prompt}, 1)
    outs = _run(sched, {1: prompt + [3]}, 1)
    assert outs[1][0].cached_tokens == 4 and sched.cache.cached_pages >= 1


def test_without_longrope_nothing_changes() -> None:
    sched = _scheduler(original=None)
    prompt = list(range(10, 30))
    _run(sched, {0: prompt}, 12)
    assert _run(sched, {1: prompt + [5]}, 1)[1][0].cached_tokens == 20


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sequence_growing_past_it_is_computed_again(overlap: bool) -> None:
    """Prompt 5, 10 new tokens: at 9 tokens (position 8 next) the request is computed again
    from position 0, once, and continues as a long one; a second short prompt still matches
    the short-factor pages the first one left behind."""
    sched = _scheduler(overlap)
    prompt = list(range(60, 65))
    _run(sched, {0: prompt}, 10)
    recomputed = [step.get(0) for step in sched.engine.steps]  # type: ignore[attr-defined]
    starts = [r for r in recomputed if r is not None and r.cached_len == 0]
    assert [(r.extend_len, r.total_len) for r in starts] == [(5, 5), (ORIGINAL + 1, ORIGINAL + 1)]
    assert sched.num_retractions == 0  # not counted as a preemption
    assert sched.cache.cached_pages == 2, "the first 8 (short-factor) positions stay cached"
    outs = _run(sched, {1: prompt + [1, 2]}, 1)
    assert outs[1][0].cached_tokens == 4  # whole pages of the shared 5-token prefix
