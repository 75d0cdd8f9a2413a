"""Pages behind the sliding window go back to the pool when every layer has the window
(Mistral v0.1, Phi-3-mini-4k: `ModelConfig.kv_window`), against the model-free fake engine: it
checks each step's pages, and that every position inside the window still reads its own tokens
(`FakeModelConfig.kv_window`). Models with a global layer keep every page."""

from __future__ import annotations

import pytest

from minisgl.core import SamplingParams
from minisgl.message.tokenizer import TokenOut
from minisgl.models.config import ModelConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.pages import pages_for
from minisgl.scheduler.scheduler import Scheduler
from tests.unit.fake_engine import FakeEngine, FakeModelConfig, check_scheduler_state, expected_output

WINDOW = 8
PS = 4
CONTEXT = 256


def _scheduler(cache: str = "radix", overlap: bool = False, num_pages: int = 128, window: int | None = WINDOW,
               budget: int = 64) -> Scheduler:  # fmt: skip
    engine = FakeEngine(page_size=PS, num_pages=num_pages, context_len=CONTEXT, max_running_requests=4)
    engine.model_config = FakeModelConfig((), 1000, kv_window=window)
    config = SchedulerConfig(max_running_requests=4, max_prefill_tokens=budget, cache=cache,  # type: ignore[arg-type]
                             overlap=overlap, decode_reserve_tokens=4)  # fmt: skip
    return Scheduler(engine, config)


def _run(sched: Scheduler, reqs: dict[int, list[int]], max_tokens: int) -> tuple[dict[int, list[TokenOut]], int]:
    """Run to completion, checking every output; returns the outputs and the most pages one
    request owned at once."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in reqs.items():
        sched.add_request(rid, prompt, params)
    outs: dict[int, list[TokenOut]] = {rid: [] for rid in reqs}
    most_owned = 0
    for _ in range(400):
        if not sched.has_work():
            break
        for out in sched.step():
            outs[out.rid].append(out)
        check_scheduler_state(sched)
        for req in sched.running:
            most_owned = max(most_owned, len(req.pages) - max(req.shared_pages, req.slid_pages))
    assert not sched.has_work()
    for rid, prompt in reqs.items():
        expected, _ = expected_output(prompt, params, sched.engine.next_token, (), CONTEXT)  # type: ignore[attr-defined]
        assert [t for out in outs[rid] for t in out.token_ids] == expected, f"rid {rid}"
    return outs, most_owned


@pytest.mark.parametrize("overlap", [False, True])
def test_naive_cache_keeps_only_the_window(overlap: bool) -> None:
    sched = _scheduler("naive", overlap, budget=8)  # an 8-token budget: the prompt slides while prefilling too
    _, most = _run(sched, {0: list(range(10, 40)), 1: list(range(50, 53))}, 40)
    # The window's pages, the page being written and one reserved ahead.
    assert most <= pages_for(WINDOW, PS) + 2, most


def test_radix_keeps_cached_prompt_pages_and_slides_the_decode() -> None:
    sched = _scheduler("radix")
    prompt = list(range(10, 30))  # 5 pages, cached while prefilling
    _, most = _run(sched, {0: prompt}, 40)
    assert most <= pages_for(WINDOW, PS) + 2, most
    assert sched.cache.cached_pages == 5, "a prefix with holes is not cached; the prompt's pages stay"
    outs, _ = _run(sched, {1: prompt + [7, 8]}, 3)
    assert outs[1][0].cached_tokens == 20


def test_short_requests_keep_every_page_and_cache_them() -> None:
    sched = _scheduler("radix")
    prompt = [3, 4, 5]
    outs, _ = _run(sched, {0: prompt}, 5)  # 8 tokens: never past the window
    assert sched.cache.cached_pages == 1
    tokens = [t for out in outs[0] for t in out.token_ids]
    assert _run(sched, {1: prompt + tokens[:4] + [9]}, 2)[0][1][0].cached_tokens == 4


def test_without_a_window_on_every_layer_nothing_slides() -> None:
    sched = _scheduler("naive", window=None)
    _, most = _run(sched, {0: list(range(10, 40))}, 40)
    assert most == pages_for(30 + 40 - 2, PS)  # (the step computing the last position ends the request)


@pytest.mark.parametrize("cache", ["naive", "radix"])
def test_retracting_a_request_with_slid_pages(cache: str) -> None:
    """Retracted (preempted) after its pages slid: it recomputes from scratch, caches nothing
    with holes, and every page is accounted for."""
    sched = _scheduler(cache)
    prompt = list(range(10, 22))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    sched.add_request(0, prompt, params)
    tokens: list[int] = []
    retracted = False
    for _ in range(200):
        if not sched.has_work():
            break
        tokens += [t for out in sched.step() for t in out.token_ids]
        check_scheduler_state(sched)
        if not retracted and sched.running and sched.running[0].slid_pages >= 2:
            sched._retract(sched.running[0])
            retracted = True
            check_scheduler_state(sched)
    assert retracted and sched.num_retractions == 1
    assert tokens == expected_output(prompt, params, sched.engine.next_token, (), CONTEXT)[0]  # type: ignore[attr-defined]
    sched.check_idle_invariants()


def test_page_manager_slide_and_release() -> None:
    from minisgl.core import Req
    from minisgl.scheduler.pages import PageManager

    pm = PageManager(num_pages=16, page_size=PS, cache="radix", num_rows=2)
    req = Req(0, list(range(1, 13)), SamplingParams(max_tokens=20))
    pm.attach(req, pm.no_match())
    assert pm.reserve(req, 12)
    req.cached_len = 12
    pm.cache_prefix(req)  # 3 prompt pages cache-owned
    pm.slide(req, WINDOW)  # the window reaches back into cache-owned pages: nothing to return
    assert (req.shared_pages, req.slid_pages, pm.allocator.num_free) == (3, 0, 13)
    req.output_ids = list(range(100, 112))
    assert pm.reserve(req, 12)
    req.cached_len = 24
    pm.slide(req, WINDOW)  # the next position (24) sees 17..24: pages 3 (12..15) goes back
    assert req.slid_pages == 4 and pm.allocator.num_free == 16 - 3 - 3 + 1
    pm.cache_prefix(req)  # a prefix with holes is not cached
    assert req.shared_pages == 3 and pm.cache.cached_pages == 3
    pm.release(req)
    assert pm.cache.cached_pages == 3 and pm.allocator.num_free == 13
    pm.check_idle()


def test_kv_window_needs_every_layer_windowed() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 100,
            "intermediate_size": 128, "max_position_embeddings": 256}  # fmt: skip
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.kv_window == 32
    gemma3 = ModelConfig.from_dict({**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 32,
                                    "sliding_window_pattern": 2})  # fmt: skip
    assert gemma3.layer_window(0) == 32 and gemma3.kv_window is None
    assert ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]}).kv_window is None
