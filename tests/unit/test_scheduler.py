"""Scheduler decisions against a model-free fake engine that checks every step plan.

Each test drives `Scheduler.step()` by hand (with overlap scheduling off unless a test says so:
then outputs arrive one step late and step-by-step expectations shift); after every step the harness checks page and row
ownership (`check_scheduler_state`), and the fake engine checks that every request reads exactly
its own tokens through its token table. Outputs are compared with `expected_output`, a reference
that knows nothing about pages, batching or retraction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.message.tokenizer import TokenOut
from minisgl.scheduler.scheduler import Scheduler
from tests.unit.fake_engine import (
    FakeEngine, NextToken, ReqStep, StepRecord, check_scheduler_state, expected_output,
)


@dataclass
class Result:
    prompt: list[int]
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    cached_tokens: int | None = None


class Harness:
    def __init__(
        self,
        *,
        page_size: int = 4,
        num_pages: int = 256,
        cache: str = "radix",
        max_running: int = 8,
        budget: int = 64,
        reserve: int = 8,
        context_len: int = 512,
        vocab_size: int = 1000,
        eos_ids: tuple[int, ...] = (),
        next_token: NextToken | None = None,
        overlap: bool = False,
        dedupe_prefill: bool = True,
    ) -> None:
        self.engine = FakeEngine(
            page_size=page_size, num_pages=num_pages, context_len=context_len, vocab_size=vocab_size,
            eos_ids=eos_ids, max_running_requests=max_running, next_token=next_token,
        )
        config = SchedulerConfig(
            max_running_requests=max_running, max_prefill_tokens=budget, cache=cache,  # type: ignore[arg-type]
            decode_reserve_tokens=reserve, overlap=overlap, dedupe_prefill=dedupe_prefill,
        )
        self.sched = Scheduler(self.engine, config)
        self.results: dict[int, Result] = {}
        self.retractions: list[tuple[int, ...]] = []  # rids retracted, per step that retracted any

    def add(self, rid: int, prompt: list[int], **sampling: object) -> None:
        params = SamplingParams(**sampling)  # type: ignore[arg-type]
        self.sched.add_request(rid, prompt, params)
        self.results[rid] = Result(list(prompt), params)

    @property
    def steps(self) -> list[StepRecord]:
        return self.engine.steps

    def step(self) -> list[TokenOut]:
        sched = self.sched
        # Output tokens known on the host (with overlap the newest may still be a placeholder).
        before = [(req, req.arrival, req.output_ids[: req.output_len - req.num_pending]) for req in sched.running]
        outs = sched.step()
        check_scheduler_state(sched)
        # A request that left the running set without finishing, or came back with a new arrival,
        # was retracted: it must be among the newest, keep its outputs and wait at the front.
        retracted = [(req, arrival, ids) for req, arrival, ids in before
                     if not req.finished and (req.row is None or req.arrival != arrival)]
        if retracted:
            # Victims are always the newest resident, so each is newer than every request that
            # stayed resident throughout (with overlap a victim may also finish meanwhile).
            kept = [arrival for req, arrival, _ in before if req in sched.running and req.arrival == arrival]
            assert min(a for _, a, _ in retracted) > max(kept, default=-1), "retracted an older request"
            for req, _, ids in retracted:
                # (It may have been re-admitted, recomputed and sampled again within the same step.)
                assert req.output_ids[: len(ids)] == ids, f"rid {req.rid} lost outputs on retraction"
                assert req in sched.waiting or req in sched.running
            self.retractions.append(tuple(req.rid for req, _, _ in retracted))
        for out in outs:
            res = self.results[out.rid]
            assert res.finish is None, f"rid {out.rid} produced output after finishing"
            res.tokens.extend(out.token_ids)
            assert out.output_tokens == len(res.tokens) and out.prompt_tokens == len(res.prompt)
            assert res.cached_tokens in (None, out.cached_tokens), "cached_tokens changed mid-request"
            res.cached_tokens = out.cached_tokens
            res.finish = out.finish_reason
        return outs

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                self.sched.check_idle_invariants()
                return
            self.step()
        raise AssertionError("scheduler did not drain")

    def expected(self, rid: int) -> tuple[list[int], str]:
        res = self.results[rid]
        return expected_output(
            res.prompt, res.sampling, self.engine.next_token, self.engine.model_config.eos_ids, self.engine.context_len
        )

    def assert_all_expected(self, skip: frozenset[int] = frozenset()) -> None:
        for rid, res in self.results.items():
            if rid in skip:
                continue
            tokens, finish = self.expected(rid)
            assert (res.tokens, res.finish) == (tokens, finish), f"rid {rid}"


def prompt_of(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 997 + 1 for i in range(n)]


# ---- admission ----------------------------------------------------------------------------


def test_admission_respects_max_running_requests() -> None:
    h = Harness(max_running=2)
    for rid in range(5):
        h.add(rid, prompt_of(6, 10 * rid), max_tokens=3 + rid)
    h.step()
    assert h.steps[0].rids == [0, 1]
    assert len(h.sched.running) == 2 and [r.rid for r in h.sched.waiting] == [2, 3, 4]
    h.run()
    assert max(len(s.reqs) for s in h.steps) == 2
    # Request 0 finishes in step 3 (3 tokens); request 2 takes its row in the very next step.
    first_step = {rid: next(i for i, s in enumerate(h.steps) if rid in s.rids) for rid in range(5)}
    assert first_step[2] == 3
    h.assert_all_expected()


@pytest.mark.parametrize("reserve", [8, 0])
def test_admission_keeps_a_decode_reserve(reserve: int) -> None:
    # 10 pages of 4. A: 16 prompt tokens (4 pages), admitted alone. B: 12 tokens need 3 pages plus
    # 2 for its decode reserve, and A keeps 2 reserve pages: 7 > 6 free, so B waits for A to finish.
    # Without a reserve B needs only its 3 prompt pages and joins at once.
    h = Harness(page_size=4, num_pages=10, reserve=reserve)
    h.add(0, prompt_of(16), max_tokens=8)
    h.add(1, prompt_of(12, 100), max_tokens=20)
    h.run()
    first_b = next(i for i, s in enumerate(h.steps) if 1 in s.rids)
    last_a = max(i for i, s in enumerate(h.steps) if 0 in s.rids)
    assert first_b == (last_a + 1 if reserve else 0)
    if reserve:
        assert h.sched.num_retractions == 0
    h.assert_all_expected()


def test_a_lone_request_is_admitted_even_if_its_reserve_does_not_fit() -> None:
    h = Harness(page_size=4, num_pages=5, reserve=64)
    h.add(0, prompt_of(16), max_tokens=4)
    h.run()
    h.assert_all_expected()


# ---- chunked prefill and continuous batching -----------------------------------------------


def test_long_prompt_is_chunked_while_decodes_continue() -> None:
    budget = 8
    h = Harness(budget=budget)
    h.add(0, prompt_of(4), max_tokens=20)
    h.step()
    h.add(1, prompt_of(30, 50), max_tokens=5)
    h.step()
    h.add(2, prompt_of(5, 300), max_tokens=3)
    while h.results[1].tokens == []:
        h.step()
    chunks = [s.get(1) for s in h.steps if s.get(1) is not None]
    assert [(c.cached_len, c.extend_len, c.sampled) for c in chunks] == [  # type: ignore[union-attr]
        (0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)
    ]  # ceil(30 / 8) = 4 steps
    for step in h.steps[1:]:
        a = step.get(0)
        assert a is not None and a.extend_len == 1 and a.sampled, "the decode missed a step"
    # Request 2 waited while 1 used the whole budget, then took the 2 tokens left in the last chunk.
    assert [s.get(2) is not None for s in h.steps] == [False, False, False, False, True]
    assert h.steps[-1].get(2).extend_len == 2  # type: ignore[union-attr]
    h.run()
    for step in h.steps:
        assert sum(r.extend_len for r in step.reqs if not r.is_decode) <= budget
    h.assert_all_expected()


@pytest.mark.parametrize("cache", ["radix", "naive"])
def test_finished_requests_leave_at_once_and_free_their_pages(cache: str) -> None:
    h = Harness(cache=cache, page_size=4, num_pages=64)
    h.add(0, prompt_of(10), max_tokens=2)
    h.add(1, prompt_of(7, 40), max_tokens=6)
    h.step()
    outs = h.step()
    assert {o.rid: o.finish_reason for o in outs} == {0: "length", 1: None}
    assert [r.rid for r in h.sched.running] == [1]
    running = h.sched.running[0]
    held = len(running.pages) - running.shared_pages  # pages the request owns (not the cache's)
    stats = h.sched.stats()
    assert stats.free_pages + stats.cached_pages + held == stats.total_pages
    # Request 0 computed 11 tokens: 2 whole pages stay cached with radix, none with naive.
    # Request 1's prefill (7 tokens) is shared at once: 1 more whole page with radix.
    assert stats.cached_pages == (3 if cache == "radix" else 0)
    h.step()
    assert h.steps[-1].rids == [1]
    h.run()
    h.assert_all_expected()


# ---- retraction ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", ["radix", "naive"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_preemption_retracts_the_newest_and_reproduces_outputs(cache: str, page_size: int, overlap: bool) -> None:
    def workload(num_pages: int) -> Harness:
        h = Harness(cache=cache, page_size=page_size, num_pages=num_pages, reserve=0, overlap=overlap)
        for rid in range(4):
            h.add(rid, prompt_of(8, 37 * rid), max_tokens=20, ignore_eos=True)
        h.run()
        return h

    tiny = workload(48 // page_size)  # 4 requests of up to 28 tokens each: 112 > 48
    huge = workload(1024)
    assert tiny.sched.num_retractions > 0 and tiny.retractions
    assert huge.sched.num_retractions == 0
    for rid in range(4):
        assert tiny.results[rid].tokens == huge.results[rid].tokens
        assert tiny.results[rid].finish == huge.results[rid].finish == "length"
    tiny.assert_all_expected()
    # The oldest request is never the victim while others run.
    assert all(0 not in rids for rids in tiny.retractions)


def test_retracted_request_resumes_from_its_cached_prefix() -> None:
    # 5 pages of 4: A (8 tokens) and B (10 tokens) fill the pool. A's first decode needs a page:
    # B, the newest, is retracted; its 2 whole pages stay cached and its partial page is freed for
    # A. A finishes within that page, then B resumes from 8 cached tokens.
    h = Harness(cache="radix", page_size=4, num_pages=5, reserve=0)
    h.add(0, prompt_of(8), max_tokens=4, ignore_eos=True)
    h.add(1, prompt_of(10, 100), max_tokens=5, ignore_eos=True)
    h.run()
    assert h.retractions == [(1,)]
    b_steps = [(r.cached_len, r.extend_len) for s in h.steps if (r := s.get(1)) is not None]
    assert b_steps[:2] == [(0, 10), (8, 3)]
    assert h.results[1].cached_tokens == 0  # reported for the first admission only
    h.assert_all_expected()


# ---- prefix cache -------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache, page_size", [("radix", 4), ("radix", 1), ("naive", 4)])
def test_shared_prefix_is_reported_as_cached_tokens(cache: str, page_size: int, overlap: bool) -> None:
    h = Harness(cache=cache, page_size=page_size, overlap=overlap)
    shared = prompt_of(42, 7)
    h.add(0, shared + prompt_of(8, 500), max_tokens=3)
    h.run()
    h.add(1, shared + prompt_of(8, 600), max_tokens=3)
    h.add(2, shared + prompt_of(8, 500), max_tokens=3)  # the same prompt as request 0
    h.run()
    aligned = 42 // page_size * page_size
    same = 49 // page_size * page_size  # all but the last prompt token may come from the cache
    want = {0: 0, 1: aligned, 2: same} if cache == "radix" else {0: 0, 1: 0, 2: 0}
    assert {rid: h.results[rid].cached_tokens for rid in range(3)} == want
    first = {rid: next(s.get(rid) for s in h.steps if s.get(rid) is not None) for rid in (1, 2)}
    assert first[1].cached_len == want[1] and first[2].cached_len == want[2]  # type: ignore[union-attr]
    h.assert_all_expected()


def test_a_prefix_is_shared_between_chunks_of_a_running_prefill() -> None:
    h = Harness(cache="radix", page_size=4, budget=16)
    shared = prompt_of(40, 3)
    h.add(0, shared + prompt_of(20, 400), max_tokens=2)
    h.step()
    h.step()  # request 0 has computed 32 tokens, cached page by page
    h.add(1, shared + prompt_of(4, 800), max_tokens=2)
    h.run()
    assert h.results[1].cached_tokens == 40
    h.assert_all_expected()


def test_flush_cache_returns_the_pool_to_full() -> None:
    h = Harness(cache="radix", page_size=4, num_pages=64)
    for rid in range(3):
        h.add(rid, prompt_of(20, rid), max_tokens=5)
    h.run()
    assert h.sched.stats().cached_pages > 0
    h.sched.check_idle_invariants()
    h.sched.flush_cache()
    stats = h.sched.stats()
    assert stats.free_pages == stats.total_pages == 64 and stats.cached_pages == 0


# ---- abort ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["radix", "naive"])
def test_abort_waiting_and_running_requests_frees_everything(cache: str) -> None:
    h = Harness(cache=cache, max_running=1, budget=8)
    h.add(0, prompt_of(20), max_tokens=10)
    h.add(1, prompt_of(5, 70), max_tokens=10)
    h.step()  # request 0 is mid-prefill, request 1 waits
    assert h.sched.abort(1) and not h.sched.waiting
    assert not h.sched.abort(1), "a second abort of the same request"
    assert not h.sched.abort(12345)
    check_scheduler_state(h.sched)
    h.step()
    assert h.sched.abort(0)
    assert not h.sched.has_work()
    h.sched.check_idle_invariants()
    h.sched.flush_cache()
    assert h.sched.stats().free_pages == h.sched.stats().total_pages
    # Aborting a decoding request works the same way.
    h.add(2, prompt_of(6, 90), max_tokens=10)
    h.step()
    h.step()
    assert h.sched.abort(2)
    h.sched.check_idle_invariants()
    assert not h.sched.abort(2)


def test_row_of_an_aborted_request_does_not_inherit_its_pending_table_entries() -> None:
    """A and B prefill the same 24 tokens in one step; A caches them first, so B switches to A's
    copies and the token-table update for that is deferred to the next plan. B is aborted first;
    C, sharing only the start of the prefix, takes B's row and computes those very positions in
    its first step: the deferred entries for B must not overwrite C's own slots. (B would wait for
    A's prefill instead, so that is turned off here.)"""
    h = Harness(cache="radix", page_size=4, budget=64, dedupe_prefill=False)
    x = prompt_of(24, 11)
    h.add(0, x, max_tokens=3, ignore_eos=True)  # A
    h.add(2, x + prompt_of(12, 200), max_tokens=4)  # B
    h.step()  # both prefill at once; A caches x[:24] first, B's pages for it are duplicates
    b_row = h.steps[-1].get(2).row  # type: ignore[union-attr]
    assert h.sched.abort(2)
    h.add(3, x[:16] + prompt_of(12, 700), max_tokens=2)  # C: takes B's row, computes from 16
    h.run()
    first_c = next(s.get(3) for s in h.steps if s.get(3) is not None)
    assert (first_c.row, first_c.cached_len) == (b_row, 16)  # type: ignore[union-attr]
    h.assert_all_expected(skip=frozenset({2}))


# ---- stop conditions --------------------------------------------------------------------------


def _counting(vocab: int) -> NextToken:
    return lambda history: (history[-1] + 1) % vocab


@pytest.mark.parametrize(
    "prompt, sampling, tokens, finish",
    [
        ([3], {"max_tokens": 10}, [4, 5, 6, 7], "stop"),  # eos 7
        ([3], {"max_tokens": 6, "ignore_eos": True}, [4, 5, 6, 7, 8, 9], "length"),
        ([3], {"max_tokens": 10, "stop_token_ids": [5]}, [4, 5], "stop"),
        ([3], {"max_tokens": 10, "ignore_eos": True, "stop_token_ids": [9]}, [4, 5, 6, 7, 8, 9], "stop"),
        ([3], {"max_tokens": 2}, [4, 5], "length"),
        ([10, 11, 12, 13, 14], {"max_tokens": 100}, [15, 16, 17], "length"),  # context length 8
        ([20] * 7, {"max_tokens": 100}, [21], "length"),
    ],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_stop_conditions(prompt: list[int], sampling: dict, tokens: list[int], finish: str, overlap: bool) -> None:
    h = Harness(
        context_len=8, vocab_size=100, eos_ids=(7,), next_token=_counting(100), page_size=2, num_pages=8,
        overlap=overlap,
    )
    h.add(0, prompt, **sampling)
    h.run()
    assert (h.results[0].tokens, h.results[0].finish) == (tokens, finish)
    h.assert_all_expected()


# ---- input validation -------------------------------------------------------------------------


def test_add_request_refuses_what_only_the_scheduler_knows() -> None:
    # The request's content (empty prompt, context, vocabulary, KV pool) is checked at the entry,
    # by RequestTokenizer: tests/unit/test_request_entry.py::test_entry_rejects_bad_input.
    h = Harness(page_size=4, num_pages=4, context_len=32, vocab_size=50)
    ok = SamplingParams(max_tokens=4)
    h.sched.add_request(0, [1] * 10, SamplingParams(max_tokens=6))  # exactly 16 tokens fits
    with pytest.raises(ValueError, match="already in use"):
        h.sched.add_request(0, [1, 2], ok)
    assert list(h.sched.reqs) == [0] and len(h.sched.waiting) == 1  # the refused one queued nothing


def test_pool_check_caps_the_request_at_the_context_length() -> None:
    h = Harness(page_size=4, num_pages=4, context_len=16)
    h.add(0, prompt_of(10), max_tokens=1000, ignore_eos=True)  # never more than 16 tokens of KV
    h.run()
    assert len(h.results[0].tokens) == 6 and h.results[0].finish == "length"


# ---- randomized stress --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", ["radix", "naive"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_randomized_arrivals_and_aborts(cache: str, page_size: int, overlap: bool, seed: int) -> None:
    rng = random.Random(f"{seed}-{page_size}-{cache}-{overlap}")
    vocab, context_len, pool_tokens = 64, 64, 64
    h = Harness(
        cache=cache, page_size=page_size, num_pages=pool_tokens // page_size, max_running=6,
        budget=rng.choice([6, 8, 24]), reserve=rng.choice([0, 4]), context_len=context_len, vocab_size=vocab,
        eos_ids=(0,), overlap=overlap,
    )
    prefixes = [[rng.randrange(1, vocab) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    aborted: set[int] = set()
    next_rid = 0
    for _ in range(4000):
        if next_rid < 300 and rng.random() < 0.5:
            for _ in range(min(rng.choice([1, 1, 2, 4]), 300 - next_rid)):
                prefix = rng.choice(prefixes)
                shared = prefix[: rng.choice([len(prefix), rng.randint(0, len(prefix))])]
                prompt = shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
                h.add(  # at most 36 + 24 tokens: always fits the 64-token pool
                    next_rid, prompt, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.3,
                    stop_token_ids=[rng.randrange(vocab)] if rng.random() < 0.2 else [],
                )
                next_rid += 1
        if h.sched.reqs and rng.random() < 0.04:
            rid = rng.choice(sorted(h.sched.reqs))
            assert h.sched.abort(rid)
            aborted.add(rid)
            check_scheduler_state(h.sched)
        if h.sched.has_work():
            h.step()
        else:
            h.sched.check_idle_invariants()
            if rng.random() < 0.3:
                h.sched.flush_cache()
            if next_rid >= 300:
                break
    h.run()
    assert next_rid == 300
    assert h.sched.num_retractions > 0, "the stress run never ran out of pages"
    if cache == "radix":
        assert any(res.cached_tokens for res in h.results.values()), "no prefix was ever reused"
    h.assert_all_expected(skip=frozenset(aborted))
    for rid in aborted:  # what an aborted request produced is still a prefix of its true output
        tokens, _ = h.expected(rid)
        assert tokens[: len(h.results[rid].tokens)] == h.results[rid].tokens
    h.sched.flush_cache()
    assert h.sched.stats().free_pages == h.sched.stats().total_pages
