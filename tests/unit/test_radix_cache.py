from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from minisgl.kvcache import (
    PREFIX_CACHES,
    BasePrefixCache,
    CacheHandle,
    NaivePrefixCache,
    PageAllocator,
    RadixPrefixCache,
    create_prefix_cache,
)


def seq(page_size: int, *page_labels: int) -> list[int]:
    """Token ids for whole pages; page `label` is `page_size` copies of `label`."""
    return [label for label in page_labels for _ in range(page_size)]


# ---- match / insert ---------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_exact_match(page_size: int) -> None:
    cache = RadixPrefixCache(page_size)
    tokens = seq(page_size, 1, 2, 3)
    res = cache.insert(tokens, [10, 11, 12])
    assert res.pages == [10, 11, 12] and res.pages_to_free == []
    got = cache.match(tokens)
    assert got.pages == [10, 11, 12]
    assert got.handle is res.handle
    assert cache.cached_pages == 3 and cache.evictable_pages == 3
    cache.check_invariants()


def test_partial_page_is_not_matched() -> None:
    cache = RadixPrefixCache(4)
    cache.insert(seq(4, 1, 2), [7, 8])
    # 6 tokens: one whole page plus half of the second.
    assert cache.match(seq(4, 1, 2)[:6]).pages == [7]
    # Longer query that agrees on 7 tokens: still only the first page.
    assert cache.match(seq(4, 1, 2)[:7] + [99]).pages == [7]
    cache.check_invariants()


@pytest.mark.parametrize("tokens", [[], [1], [1, 1, 1]])
def test_query_shorter_than_a_page_matches_nothing(tokens: list[int]) -> None:
    cache = RadixPrefixCache(4)
    cache.insert(seq(4, 1), [3])
    got = cache.match(tokens)
    assert got.pages == [] and got.handle is cache.root


@pytest.mark.parametrize("page_size", [1, 4])
def test_split_on_divergence_keeps_both_branches(page_size: int) -> None:
    cache = RadixPrefixCache(page_size)
    cache.insert(seq(page_size, 1, 2, 3), [0, 1, 2])
    # Same first page, different second page: the edge splits after page 0.
    res = cache.insert(seq(page_size, 1, 5, 6), [20, 21, 22])
    assert res.pages == [0, 21, 22]
    assert res.pages_to_free == [20]
    assert cache.match(seq(page_size, 1, 2, 3)).pages == [0, 1, 2]
    assert cache.match(seq(page_size, 1, 5, 6)).pages == [0, 21, 22]
    assert cache.match(seq(page_size, 1, 7)).pages == [0]
    assert cache.cached_pages == 5
    cache.check_invariants()


def test_match_ending_inside_an_edge_splits_so_the_handle_covers_only_the_match() -> None:
    cache = RadixPrefixCache(2)
    cache.insert(seq(2, 1, 2, 3), [0, 1, 2])
    got = cache.match(seq(2, 1, 2, 9))
    assert got.pages == [0, 1]
    cache.lock(got.handle)
    assert cache.evictable_pages == 1
    assert cache.evict(10) == [2]  # only the unmatched tail goes
    assert cache.match(seq(2, 1, 2, 3)).pages == [0, 1]
    cache.check_invariants()


def test_insert_of_a_strict_prefix_of_an_edge_splits_and_returns_existing_pages() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    res = cache.insert([1, 2], [8, 9])
    assert res.pages == [0, 1] and res.pages_to_free == [8, 9]
    cache.lock(res.handle)
    assert sorted(cache.evict(10)) == [2, 3]  # the handle pins exactly the 2-page prefix
    cache.check_invariants()


def test_duplicate_insert_returns_existing_pages_and_reports_duplicates() -> None:
    cache = RadixPrefixCache(2)
    tokens = seq(2, 4, 5)
    first = cache.insert(tokens, [0, 1])
    again = cache.insert(tokens, [6, 7])
    assert again.pages == [0, 1] and again.pages_to_free == [6, 7]
    assert again.handle is first.handle
    # Re-inserting one's own pages (chunked prefill caching a longer prefix) frees nothing.
    longer = cache.insert(seq(2, 4, 5, 6), [0, 1, 8])
    assert longer.pages == [0, 1, 8] and longer.pages_to_free == []
    assert cache.cached_pages == 3
    cache.check_invariants()


def test_insert_rejects_partial_pages() -> None:
    cache = RadixPrefixCache(4)
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], [0])


# ---- lock / evict -----------------------------------------------------------------------


def test_lock_prevents_eviction_of_the_whole_path() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2], [0, 1])
    deep = cache.insert([1, 2, 3], [0, 1, 2])
    cache.lock(deep.handle)
    assert cache.evictable_pages == 0
    assert cache.evict(100) == []
    cache.unlock(deep.handle)
    assert cache.evictable_pages == 3
    freed = cache.evict(100)
    assert freed[0] == 2 and sorted(freed[1:]) == [0, 1]  # the leaf first, then its parent
    assert cache.cached_pages == 0
    cache.check_invariants()


def test_unlock_then_evict_in_lru_order() -> None:
    cache = RadixPrefixCache(1)
    handles = [cache.insert([label], [label]).handle for label in (0, 1, 2)]
    for handle in handles:
        cache.lock(handle)
    assert cache.evict(1) == []
    for handle in handles:
        cache.unlock(handle)
    cache.match([0])  # 0 becomes most recently used
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [0]
    assert cache.evict(1) == []
    cache.check_invariants()


def test_evict_frees_leaves_before_parents() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2], [0, 1])
    cache.insert([1, 3], [0, 2])  # parent [1] now has two leaves
    cache.insert([9], [3])  # oldest after the touches below
    cache.match([1, 2])
    cache.match([1, 3])
    assert cache.evict(1) == [3]
    assert cache.evict(1) == [1]  # older leaf of the shared parent
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [0]  # the parent only once it became a leaf
    cache.check_invariants()


def test_evict_may_overshoot_by_one_node() -> None:
    cache = RadixPrefixCache(2)
    cache.insert(seq(2, 1, 2, 3), [0, 1, 2])
    assert cache.evict(1) == [0, 1, 2]  # one node of three pages is not split to free one page
    assert cache.cached_pages == 0 and cache.evictable_pages == 0


def test_split_inherits_the_lock_count() -> None:
    cache = RadixPrefixCache(1)
    res = cache.insert([1, 2, 3], [0, 1, 2])
    cache.lock(res.handle)
    cache.lock(res.handle)
    got = cache.match([1, 9])  # splits the locked edge after one page
    assert got.pages == [0]
    cache.lock(got.handle)
    cache.unlock(res.handle)
    cache.unlock(res.handle)
    cache.check_invariants()
    assert cache.evictable_pages == 2
    assert cache.evict(10) == [1, 2]
    cache.unlock(got.handle)
    assert cache.evict(10) == [0]
    with pytest.raises(AssertionError):
        cache.unlock(got.handle)  # stale handle: it was evicted


def test_unlock_without_lock_asserts_and_root_lock_is_a_no_op() -> None:
    cache = RadixPrefixCache(1)
    res = cache.insert([1], [0])
    with pytest.raises(AssertionError, match="unlock without"):
        cache.unlock(res.handle)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.evictable_pages == 1


def test_reset_returns_every_page_and_refuses_while_locked() -> None:
    cache = RadixPrefixCache(1)
    cache.insert([1, 2], [0, 1])
    res = cache.insert([1, 3], [5, 2])
    assert res.pages_to_free == [5]
    cache.lock(res.handle)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(res.handle)
    assert sorted(cache.reset()) == [0, 1, 2]
    assert cache.cached_pages == 0 and cache.match([1, 2]).pages == []
    cache.check_invariants()


# ---- naive cache and registry -----------------------------------------------------------


def test_naive_cache_never_matches_and_never_keeps_pages() -> None:
    cache = NaivePrefixCache(2)
    res = cache.insert(seq(2, 1, 2), [0, 1])
    assert res.handle is cache.root and res.pages == [] and res.pages_to_free == []
    assert cache.match(seq(2, 1, 2)) == (cache.root, [])
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.cached_pages == 0 and cache.evictable_pages == 0
    assert cache.evict(10) == [] and cache.reset() == []


def test_registry_creates_caches_and_names_valid_choices() -> None:
    assert PREFIX_CACHES.names() == ["naive", "radix"]
    assert isinstance(create_prefix_cache("radix", 4), RadixPrefixCache)
    naive = create_prefix_cache("naive", 4)
    assert isinstance(naive, NaivePrefixCache) and naive.page_size == 4
    with pytest.raises(ValueError, match="naive, radix"):
        create_prefix_cache("lru", 4)
    with pytest.raises(ValueError):
        create_prefix_cache("radix", 0)


# ---- randomized: scheduler-like usage against a reference model --------------------------


@dataclass
class _SimReq:
    tokens: list[int]
    pages: list[int]
    handle: CacheHandle
    owned: int  # leading pages owned by the cache (and pinned by `handle`)


class _Sim:
    """Drives a cache the way the scheduler does (uniform code for every cache) and checks it
    against a reference: a dict from cached page-prefix (token tuple) to its page id, with a
    logical access time per prefix."""

    def __init__(self, cache: BasePrefixCache, num_pages: int, seed: int) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.alloc = PageAllocator(num_pages)
        self.rng = random.Random(seed)
        self.reqs: list[_SimReq] = []
        self.reuses = isinstance(cache, RadixPrefixCache)
        self.ref: dict[tuple[int, ...], int] = {}
        self.ref_time: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.evicted_total = 0

    def prefixes(self, tokens: list[int], num_pages: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[: (i + 1) * self.page_size]) for i in range(num_pages)]

    def touch(self, tokens: list[int], num_pages: int) -> None:
        self.clock += 1
        for key in self.prefixes(tokens, num_pages):
            self.ref_time[key] = self.clock

    def expected_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for key in self.prefixes(tokens, len(tokens) // self.page_size):
            if key not in self.ref:
                break
            pages.append(self.ref[key])
        return pages

    def random_tokens(self) -> list[int]:
        # Few distinct tokens and a shared stem so prefixes collide and edges split often.
        stem = [7] * self.rng.randrange(0, 3 * self.page_size)
        return stem + [self.rng.randrange(3) for _ in range(self.rng.randrange(0, 6 * self.page_size))]

    def op_start(self) -> None:
        tokens = self.random_tokens()
        got = self.cache.match(tokens)
        assert got.pages == self.expected_match(tokens)
        if got.pages:
            self.touch(tokens, len(got.pages))
        self.cache.lock(got.handle)  # lock before evicting, or the match could be evicted
        need = -(-len(tokens) // self.page_size) - len(got.pages)
        fresh = self.alloc.alloc(need)
        if fresh is None:
            self.release(self.cache.evict(need - self.alloc.num_free))
            fresh = self.alloc.alloc(need)
        if fresh is None:
            self.cache.unlock(got.handle)
            return
        self.reqs.append(_SimReq(tokens, got.pages + fresh, got.handle, len(got.pages)))

    def cache_prefix(self, req: _SimReq, num_pages: int) -> None:
        assert num_pages >= req.owned
        offered = req.pages[:num_pages]
        res = self.cache.insert(req.tokens[: num_pages * self.page_size], offered)
        expected: list[int] = []
        if self.reuses:
            for key, page in zip(self.prefixes(req.tokens, num_pages), offered):
                expected.append(self.ref.setdefault(key, page))
            if num_pages:
                self.touch(req.tokens, num_pages)
        assert res.pages == expected
        assert res.pages_to_free == [mine for mine, kept in zip(offered, expected) if mine != kept]
        self.alloc.free(res.pages_to_free)
        req.pages[: len(res.pages)] = res.pages
        self.cache.lock(res.handle)
        self.cache.unlock(req.handle)
        req.handle, req.owned = res.handle, len(res.pages)

    def op_insert(self) -> None:
        req = self.rng.choice(self.reqs)
        full = len(req.tokens) // self.page_size
        self.cache_prefix(req, self.rng.randint(min(req.owned, full), full))

    def op_finish(self) -> None:
        req = self.reqs.pop(self.rng.randrange(len(self.reqs)))
        if self.rng.random() < 0.7:
            self.cache_prefix(req, len(req.tokens) // self.page_size)
        self.cache.unlock(req.handle)
        self.alloc.free(req.pages[req.owned :])

    def op_evict(self) -> None:
        want = self.rng.randrange(1, 8)
        before = self.cache.evictable_pages
        freed = self.cache.evict(want)
        assert len(freed) >= min(want, before)
        if len(freed) < want:
            assert self.cache.evictable_pages == 0
        self.release(freed)

    def release(self, freed: list[int]) -> None:
        locked = self.locked_keys()
        by_page = {page: key for key, page in self.ref.items()}
        evicted_times = []
        for page in freed:
            key = by_page[page]  # KeyError: the cache freed a page it did not hold
            assert key not in locked, "evicted a locked prefix"
            evicted_times.append(self.ref_time.pop(key))
            del self.ref[key]
        # Leaves first: what stays must still be closed under taking prefixes.
        for key in self.ref:
            assert len(key) == self.page_size or key[: -self.page_size] in self.ref
        # LRU: nothing evicted was more recent than any unlocked leaf that stayed.
        parents = {key[: -self.page_size] for key in self.ref}
        stayed = [self.ref_time[key] for key in self.ref if key not in parents and key not in locked]
        if evicted_times and stayed:
            assert max(evicted_times) <= min(stayed)
        self.evicted_total += len(freed)
        self.alloc.free(freed)

    def locked_keys(self) -> set[tuple[int, ...]]:
        return {key for req in self.reqs for key in self.prefixes(req.tokens, req.owned)}

    def check(self) -> None:
        self.cache.check_invariants()
        locked = self.locked_keys()
        assert self.cache.cached_pages == len(self.ref)
        assert self.cache.evictable_pages == len(self.ref) - len(locked)
        owners: dict[int, str] = {page: "cache" for page in self.ref.values()}
        for req in self.reqs:
            assert req.pages[: req.owned] == [self.ref[key] for key in self.prefixes(req.tokens, req.owned)]
            for page in req.pages[req.owned :]:
                assert page not in owners, f"page {page} owned twice"
                owners[page] = "request"
        for page in range(self.alloc.num_pages):
            assert self.alloc.is_free(page) == (page not in owners), f"page {page} leaked or shared"
        used_by_reqs = sum(len(req.pages) - req.owned for req in self.reqs)
        assert self.alloc.num_free + self.cache.cached_pages + used_by_reqs == self.alloc.num_pages

    def run(self, steps: int) -> None:
        ops = [self.op_start, self.op_insert, self.op_finish, self.op_evict]
        for _ in range(steps):
            op = self.rng.choices(ops, weights=[4, 2, 3, 1])[0]
            if op is not self.op_start and op is not self.op_evict and not self.reqs:
                op = self.op_start
            op()
            self.check()
            if self.rng.random() < 0.05:  # probe without locking
                tokens = self.random_tokens()
                got = self.cache.match(tokens)
                assert got.pages == self.expected_match(tokens)
                if got.pages:
                    self.touch(tokens, len(got.pages))
        while self.reqs:
            self.op_finish()
        self.check()
        assert self.cache.evictable_pages == self.cache.cached_pages  # nothing left locked
        self.release(self.cache.reset())
        assert self.alloc.num_free == self.alloc.num_pages


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_radix_matches_reference(page_size: int, seed: int) -> None:
    sim = _Sim(RadixPrefixCache(page_size), num_pages=48, seed=seed)
    sim.run(400)
    assert sim.evicted_total > 0  # the pool is small enough that eviction really happened


@pytest.mark.parametrize("page_size", [1, 4])
def test_randomized_naive_keeps_nothing(page_size: int) -> None:
    sim = _Sim(NaivePrefixCache(page_size), num_pages=48, seed=3)
    sim.run(300)
