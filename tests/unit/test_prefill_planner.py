"""`PrefillPlanner` alone over a `PageManager` and a `DecodeSet` (no engine): chunking within the
token budget, admission with a prefix match and its lock, the decode reserve, the wait for a
resident request computing a shared prefix, and a failed reservation handing the request back."""

from __future__ import annotations

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.decode import DecodeSet
from minisgl.scheduler.pages import PageManager
from minisgl.scheduler.prefill import PrefillPlanner


class Parts:
    def __init__(
        self, *, num_pages: int = 64, page_size: int = 4, budget: int = 16, reserve: int = 0,
        dedupe: bool = True, rows: int = 8,
    ) -> None:
        self.pages = PageManager(num_pages, page_size, "radix", num_rows=rows)
        self.decode = DecodeSet(self.pages)
        self.planner = PrefillPlanner(
            self.pages, self.decode, budget=budget, decode_reserve_tokens=reserve, dedupe=dedupe
        )
        self.retracted: list[int] = []

    def add(self, rid: int, prompt: list[int], **sampling: object) -> Req:
        req = Req(rid, list(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]
        self.planner.add(req)
        return req

    def retract(self, req: Req) -> None:
        self.retracted.append(req.rid)
        self.decode.remove(req)
        self.pages.release(req)
        req.cached_len = req.extend_len = 0
        self.planner.requeue(req)

    def plan(self) -> list[tuple[int, int, int]]:
        """One planning pass, then the step "runs": (rid, cached_len, extend_len) per chunk."""
        chosen: list[Req] = []
        self.planner.plan(chosen, self.retract)
        out = [(req.rid, req.cached_len, req.extend_len) for req in chosen]
        for req in chosen:
            req.cached_len += req.extend_len
            req.extend_len = 0
            self.pages.cache_prefix(req)
            if req.uncomputed_len == 0:
                req.output_ids.append(1)  # sampled: now decoding
        return out


def prompt(n: int, start: int = 1) -> list[int]:
    return [start + i for i in range(n)]


def test_prompts_are_chunked_within_the_budget_resident_first() -> None:
    p = Parts(budget=8)
    p.add(0, prompt(20))
    p.add(1, prompt(5, 100))
    assert p.plan() == [(0, 0, 8)]
    assert p.plan() == [(0, 8, 8)]
    assert p.plan() == [(0, 16, 4), (1, 0, 4)]  # the rest of 0, then 1 takes what is left
    # 1's last prompt token is computed like a decode (DecodeSet), outside the budget.
    assert p.plan() == []
    assert [r.rid for r in p.decode.running] == [0, 1] and not p.retracted


def test_admission_matches_and_locks_the_cached_prefix() -> None:
    p = Parts(budget=64)
    shared = prompt(10)
    first = p.add(0, shared + [50, 51])
    assert p.plan() == [(0, 0, 12)]
    second = p.add(1, shared + [60])
    third = p.add(2, shared + [70], prompt_logprobs=1)  # needs every prompt position's logits
    assert p.plan() == [(1, 8, 3), (2, 0, 11)]
    assert (second.prefix_len, second.shared_pages, third.prefix_len) == (8, 2, 0)
    assert second.pages[:2] == first.pages[:2]
    assert (first.arrival, second.arrival, third.arrival) == (1, 2, 3)
    assert p.pages.cache.evictable_pages == 0  # every cached page is locked by a resident request


def test_admission_waits_for_room_for_the_running_requests_decode_reserve() -> None:
    # 8 pages of 4. A: 8 tokens (2 pages) + 8 reserve tokens (2 pages) kept back. B: 12 tokens
    # (3 pages) + 2 pages of its own reserve: 2 + 2 + 5 > 8, so B waits.
    p = Parts(num_pages=8, budget=64, reserve=8)
    p.add(0, prompt(8), max_tokens=20)
    assert p.plan() == [(0, 0, 8)]
    p.add(1, prompt(12, 100), max_tokens=20)
    assert p.plan() == []
    assert [r.rid for r in p.planner.waiting] == [1] and p.pages.cache.evictable_pages == 0
    p.decode.running[0].sampling = SamplingParams(max_tokens=1)  # A may grow no more
    assert p.plan() == [(1, 0, 12)]


def test_a_lone_request_is_admitted_even_without_its_reserve() -> None:
    p = Parts(num_pages=4, budget=64, reserve=64)
    p.add(0, prompt(16), max_tokens=4)
    assert p.plan() == [(0, 0, 16)]


def test_a_shared_prefix_being_computed_is_waited_for() -> None:
    p = Parts(budget=8)
    shared = prompt(16)
    p.add(0, shared + [50])
    p.add(1, shared + [60])
    # 1 would compute the same first page as 0: it waits while 0 computes each shared page.
    assert p.plan() == [(0, 0, 8)]
    assert p.plan() == [(0, 8, 8)]
    # Then 1 matches all 16 tokens (0's last prompt token goes with the decodes).
    assert p.plan() == [(1, 16, 1)]
    assert p.decode.running[1].prefix_len == 16


def test_without_dedupe_a_shared_prefix_is_computed_twice() -> None:
    p = Parts(budget=32, dedupe=False)
    shared = prompt(16)
    p.add(0, shared + [50])
    p.add(1, shared + [60])
    assert p.plan() == [(0, 0, 17), (1, 0, 15)]


def test_admission_stops_at_the_budget_and_at_the_free_rows() -> None:
    p = Parts(budget=8, rows=2)
    for rid in range(4):
        p.add(rid, prompt(3, 10 * rid + 1))
    assert p.plan() == [(0, 0, 3), (1, 0, 3)]  # no third row
    assert [r.rid for r in p.planner.waiting] == [2, 3]


def test_a_request_that_cannot_reserve_its_chunk_goes_back_to_the_front() -> None:
    # A lone request skips the room check (it could never run otherwise); if its chunk then
    # cannot get pages (the scheduler's add_request refuses such a prompt before it gets here),
    # it is handed to `retract`, which puts it first in line again.
    p = Parts(num_pages=4, budget=64)
    p.add(0, prompt(20))
    p.add(1, prompt(3, 100))
    assert p.plan() == []
    assert p.retracted == [0] and [r.rid for r in p.planner.waiting] == [0, 1]
    assert p.pages.allocator.num_free == 4 and not p.decode.running


def test_a_request_with_a_token_in_flight_is_not_admitted() -> None:
    p = Parts()
    req = p.add(0, prompt(5))
    req.num_pending = 1  # retracted while its newest token was still being sampled
    assert p.plan() == [] and list(p.planner.waiting) == [req]
    req.num_pending = 0
    assert p.plan() == [(0, 0, 5)]
