"""`PageManager` alone (no engine, no scheduler): page reservation, allocation with eviction, the
slots of a position range, attaching a matched prefix, caching a prefix, release, the deferred
token-table entries and the idle check."""

from __future__ import annotations

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.pages import PageManager, pages_for, slots_of


def make_req(rid: int, prompt: list[int]) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_tokens=8))


def computed(pm: PageManager, req: Req, tokens: int) -> None:
    """As after a step computed `tokens` more tokens of `req` (pages reserved first)."""
    assert pm.reserve(req, tokens)
    req.cached_len += tokens


def test_pages_for_and_slots_of() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    pages = [7, 2, 9]
    assert slots_of(pages, 4, 0, 12) == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38, 39]
    assert slots_of(pages, 4, 3, 6) == [31, 8, 9]
    assert slots_of(pages, 4, 5, 6) == [9]
    assert slots_of(pages, 4, 8, 10) == [36, 37]
    assert slots_of([5, 3, 8], 1, 1, 3) == [3, 8]


def test_reserve_takes_whole_pages_and_release_returns_them() -> None:
    pm = PageManager(num_pages=8, page_size=4, cache="naive", num_rows=2)
    req = make_req(0, list(range(1, 11)))
    pm.attach(req, pm.no_match())
    assert (req.row, req.pages, req.cached_len, req.shared_pages) == (0, [], 0, 0)
    assert pm.free_rows == [1]
    assert pm.reserve(req, 10) and req.pages == [0, 1, 2]
    assert pm.reserve(req, 2) and req.pages == [0, 1, 2]  # already covered
    req.cached_len = 10
    assert pm.reserve(req, 3) and req.pages == [0, 1, 2, 3]  # 13 tokens: a fourth page
    assert not pm.reserve(req, 100) and req.pages == [0, 1, 2, 3]  # all or nothing
    assert pm.allocator.num_free == 4
    pm.release(req)
    assert (req.row, req.pages, req.cache_handle) == (None, [], None)
    assert pm.allocator.num_free == 8 and sorted(pm.free_rows) == [0, 1]
    pm.check_idle()


def test_alloc_evicts_unlocked_cached_prefixes_when_the_free_list_is_short() -> None:
    pm = PageManager(num_pages=4, page_size=2, cache="radix", num_rows=2)
    req = make_req(0, list(range(1, 9)))
    pm.attach(req, pm.no_match())
    computed(pm, req, 8)
    pm.cache_prefix(req)  # all 4 pages now cache-owned, locked by the request
    assert (pm.cache.cached_pages, pm.allocator.num_free, pm.room) == (4, 0, 0)
    assert pm.alloc(1) is None  # locked pages are never evicted
    pm.release(req)
    assert (pm.cache.cached_pages, pm.room) == (4, 4)
    pages = pm.alloc(3)
    assert pages is not None and len(pages) == 3
    assert pm.allocator.num_free + pm.cache.cached_pages + 3 == 4
    assert pm.alloc(2) is None
    assert pm.alloc(0) == []
    pm.allocator.free(pages)
    pm.check_idle()


def test_a_matched_prefix_is_attached_locked_and_written_to_the_table() -> None:
    pm = PageManager(num_pages=16, page_size=4, cache="radix", num_rows=4)
    a = make_req(0, list(range(1, 11)))
    pm.attach(a, pm.no_match())
    computed(pm, a, 10)
    pm.cache_prefix(a)  # two whole pages cached
    assert a.shared_pages == 2 and pm.take_table() == ([], [], [])  # nothing swapped
    b = make_req(1, a.prompt_ids[:8] + [99, 98])
    match = pm.match(b.all_ids[: b.total_len - 1])
    assert match.pages == a.pages[:2]
    pm.lock(match)
    pm.attach(b, match)
    assert (b.row, b.pages, b.shared_pages, b.cached_len) == (1, a.pages[:2], 2, 8)
    slots = slots_of(a.pages, 4, 0, 8)
    assert pm.take_table() == ([1] * 8, list(range(8)), slots)
    assert pm.take_table() == ([], [], [])  # handed out once
    assert pm.cache.evictable_pages == 0  # both requests hold the prefix locked
    pm.release(a)
    assert pm.cache.evictable_pages == 0
    pm.release(b)
    assert pm.cache.evictable_pages == pm.cache.cached_pages == 2
    pm.check_idle()


def test_unlock_gives_back_a_match_that_was_not_used() -> None:
    pm = PageManager(num_pages=8, page_size=2, cache="radix", num_rows=2)
    a = make_req(0, [1, 2, 3, 4, 5])
    pm.attach(a, pm.no_match())
    computed(pm, a, 5)
    pm.release(a)  # 2 whole pages cached, unlocked
    match = pm.match([1, 2, 3, 4])
    pm.lock(match)
    assert pm.room == 8 - 2
    pm.unlock(match)
    assert pm.room == 8
    pm.check_idle()


def test_caching_a_duplicate_prefix_switches_to_the_cache_copy() -> None:
    """Two requests computed the same 8 tokens in one step: the first caches them; the second
    frees its own copies, uses the cache's, and its row's table entries are deferred."""
    pm = PageManager(num_pages=8, page_size=4, cache="radix", num_rows=2)
    x = list(range(1, 9))
    a, b = make_req(0, x), make_req(1, x + [50])
    pm.attach(a, pm.no_match())
    pm.attach(b, pm.no_match())
    computed(pm, a, 8)
    computed(pm, b, 9)
    assert (a.pages, b.pages) == ([0, 1], [2, 3, 4])
    pm.cache_prefix(a)
    pm.cache_prefix(b)
    assert b.pages == [0, 1, 4] and b.shared_pages == 2
    assert pm.allocator.is_free(2) and pm.allocator.is_free(3)
    assert pm.take_table() == ([b.row] * 8, list(range(8)), list(range(8)))


def test_release_drops_the_deferred_table_entries_of_its_row() -> None:
    pm = PageManager(num_pages=8, page_size=4, cache="radix", num_rows=2)
    x = list(range(1, 9))
    a, b = make_req(0, x), make_req(1, x + [50])
    for req in (a, b):
        pm.attach(req, pm.no_match())
    computed(pm, a, 8)
    computed(pm, b, 9)
    pm.cache_prefix(a)
    pm.cache_prefix(b)
    pm.release(b)  # its row may go to another request: the entries for b must not reach it
    assert pm.take_table() == ([], [], [])
    pm.release(a)
    pm.check_idle()


def test_naive_cache_keeps_nothing() -> None:
    pm = PageManager(num_pages=4, page_size=2, cache="naive", num_rows=1)
    req = make_req(0, [1, 2, 3, 4])
    pm.attach(req, pm.match(req.all_ids))
    computed(pm, req, 4)
    pm.cache_prefix(req)
    assert req.shared_pages == 0 and pm.cache.cached_pages == 0
    pm.release(req)
    assert pm.allocator.num_free == 4
    pm.check_idle()


def test_check_idle_catches_a_leak_and_a_taken_row() -> None:
    pm = PageManager(num_pages=4, page_size=2, cache="radix", num_rows=2)
    req = make_req(0, [1, 2, 3])
    pm.attach(req, pm.no_match())
    with pytest.raises(AssertionError, match="rows still taken"):
        pm.check_idle()
    assert pm.reserve(req, 3)
    req.row, pm.free_rows = None, [1, 0]  # as if the row came back but the pages did not
    with pytest.raises(AssertionError, match="page leak"):
        pm.check_idle()
