"""`DecodeSet` alone over a `PageManager` (no engine): which resident requests decode a token this
step, the page each new token needs, the retraction victim when pages run out, and the pages
kept back for decode growth."""

from __future__ import annotations

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.decode import DecodeSet
from minisgl.scheduler.pages import PageManager


class Parts:
    def __init__(self, *, num_pages: int, page_size: int = 2, cache: str = "naive") -> None:
        self.pages = PageManager(num_pages, page_size, cache, num_rows=8)
        self.decode = DecodeSet(self.pages)
        self.retracted: list[int] = []

    def resident(self, rid: int, prompt_len: int, outputs: int, *, max_tokens: int = 16, arrival: int) -> Req:
        """A request that computed all but its newest token (decoding), holding just those pages."""
        req = Req(rid, [rid + 1 + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))
        req.output_ids = [7] * outputs
        self.pages.attach(req, self.pages.no_match())
        assert self.pages.reserve(req, req.total_len - 1)
        req.cached_len = req.total_len - 1
        req.arrival = arrival
        self.decode.add(req)
        return req

    def retract(self, req: Req) -> None:
        self.retracted.append(req.rid)
        self.decode.remove(req)
        self.pages.release(req)
        req.cached_len = 0


def test_decoding_requests_take_one_token_and_a_page_when_they_cross_one() -> None:
    p = Parts(num_pages=16)
    a = p.resident(0, 3, 1, arrival=1)  # computes position 3: its second page already holds it
    b = p.resident(1, 4, 1, arrival=2)  # computes position 4: needs a third page
    prefilling = p.resident(2, 6, 0, arrival=3)
    prefilling.cached_len = 2  # 4 prompt tokens still to compute: not a decode
    pages_before = (len(a.pages), len(b.pages))
    chosen = p.decode.plan({}, p.retract)
    assert chosen == [a, b] and a.extend_len == b.extend_len == 1 and prefilling.extend_len == 0
    assert (len(a.pages), len(b.pages)) == (pages_before[0], pages_before[1] + 1)
    assert not p.retracted


def test_a_request_whose_in_flight_token_ends_it_does_not_decode() -> None:
    p = Parts(num_pages=16)
    done = p.resident(0, 3, 4, max_tokens=4, arrival=1)  # its 4th (last) token is in flight
    done.num_pending = 1
    capped = p.resident(1, 5, 1, arrival=2)
    capped.max_total_len = capped.total_len  # at the context length
    live = p.resident(2, 3, 1, arrival=3)
    assert p.decode.plan({}, p.retract) == [live]


def test_a_grammar_request_waits_for_its_in_flight_token() -> None:
    p = Parts(num_pages=16)
    constrained = p.resident(0, 3, 1, arrival=1)
    free = p.resident(1, 3, 1, arrival=2)
    constrained.num_pending = free.num_pending = 1
    grammars = {constrained.rid: object()}
    assert p.decode.plan(grammars, p.retract) == [free]  # type: ignore[arg-type]
    constrained.extend_len = free.extend_len = 0
    constrained.num_pending = 0
    assert p.decode.plan(grammars, p.retract) == [constrained, free]  # type: ignore[arg-type]


@pytest.mark.parametrize("cache", ["naive", "radix"])
def test_the_newest_is_retracted_to_give_an_older_request_its_page(cache: str) -> None:
    p = Parts(num_pages=4, cache=cache)
    a = p.resident(0, 4, 1, arrival=1)  # 2 pages; position 4 needs a third
    b = p.resident(1, 4, 1, arrival=2)  # 2 pages: the pool is full
    assert p.decode.victim() is b
    assert p.decode.plan({}, p.retract) == [a]
    assert p.retracted == [1] and p.decode.running == [a] and len(a.pages) == 3
    assert b.row is None and b.extend_len == 0


def test_the_newest_request_needing_a_page_retracts_itself() -> None:
    p = Parts(num_pages=4)
    a = p.resident(0, 3, 1, arrival=1)  # position 3 fits its 2 pages
    b = p.resident(1, 4, 1, arrival=2)  # needs a third page; none left
    assert p.decode.plan({}, p.retract) == [a]
    assert p.retracted == [1] and b.row is None


def test_the_victim_is_the_latest_admitted_not_the_latest_listed() -> None:
    p = Parts(num_pages=16)
    p.resident(0, 3, 1, arrival=5)
    newest = p.resident(1, 3, 1, arrival=9)
    p.resident(2, 3, 1, arrival=7)
    assert p.decode.victim() is newest


def test_growth_pages_reserve_what_each_request_may_still_generate() -> None:
    p = Parts(num_pages=32, page_size=4)
    p.resident(0, 3, 1, max_tokens=20, arrival=1)  # 19 more tokens: capped by the reserve
    p.resident(1, 3, 1, max_tokens=3, arrival=2)  # 2 more tokens: 1 page
    assert p.decode.growth_pages(8) == 2 + 1
    assert p.decode.growth_pages(0) == 0
    assert DecodeSet(p.pages).growth_pages(8) == 0
