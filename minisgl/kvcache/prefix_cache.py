"""Prefix cache interface, its registry, and the no-reuse `NaivePrefixCache`.

Ownership contract (the scheduler relies on exactly this):

* Every page id is owned by exactly one of: the allocator (free), the cache, or a request.
* `match(tokens)` returns cache-owned pages for the longest cached whole-page prefix, plus a
  handle. The pages stay cache-owned; the request may read them only while it holds
  `lock(handle)`.
* `insert(tokens, pages)` offers the request's pages for that prefix to the cache. The result says
  what happened, page by page, for the *leading* `k = len(result.pages)` pages:
    - `result.pages[i]` is the cache's page for page i; from now on the request must use it in
      place of `pages[i]` and must not free it (the cache owns it; lock `result.handle`).
    - `result.pages_to_free` are the request's pages among `pages[:k]` that the cache already had
      a copy of (`pages[i] != result.pages[i]`); the request must free them now.
    - `pages[k:]` were not taken and still belong to the request (radix: k == len(pages) always;
      naive: k == 0, so the request keeps everything).
  Scheduler pattern, identical for every cache:
      res = cache.insert(tokens[: n * page_size], req_pages[:n])
      allocator.free(res.pages_to_free)
      req_pages[: len(res.pages)] = res.pages
      cache.lock(res.handle); cache.unlock(req.handle); req.handle = res.handle
      req.num_cache_owned_pages = len(res.pages)   # at finish free req_pages[that:], then unlock
  The inserted prefix must cover at least the prefix the request holds locked, so that swapping
  the lock never exposes pages the request still reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

from minisgl.utils.registry import Registry


class CacheHandle:
    """Opaque position in a prefix cache (a tree node for radix). Each cache has a root handle
    that stands for "nothing matched"; locking it is allowed and protects nothing."""

    __slots__ = ()


class MatchResult(NamedTuple):
    handle: CacheHandle  # deepest matched node; lock it to keep `pages`
    pages: list[int]  # cache-owned pages of the matched prefix: len(pages) * page_size tokens


class InsertResult(NamedTuple):
    handle: CacheHandle  # node ending exactly after the cache-owned prefix (len(pages) pages)
    pages: list[int]  # cache's pages for the leading pages it now owns; use them instead of yours
    pages_to_free: list[int]  # your pages the cache replaced with its own copy: free them now


class BasePrefixCache(ABC):
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    @property
    @abstractmethod
    def root(self) -> CacheHandle:
        """Handle standing for the empty prefix (what a request holds before any match)."""

    @abstractmethod
    def match(self, token_ids: Sequence[int], namespace: int = 0) -> MatchResult:
        """Longest cached prefix of whole pages; refreshes its LRU time; does not lock. Prefixes
        match only within their `namespace` (0: the base model; else a LoRA adapter's uid)."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Pin the handle's node and all its ancestors (nested locks count)."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one `lock(handle)`."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: Sequence[int], namespace: int = 0) -> InsertResult:
        """Offer `pages` (one per `page_size` tokens of `token_ids`) under `namespace`; see the
        module docstring."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop unlocked leaves, least recently used first, until at least `num_pages` pages are
        released (overshooting by less than one node) or nothing is evictable. Returns the page
        ids, which the caller hands back to the allocator."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages `evict` could release if asked for everything."""

    @property
    @abstractmethod
    def cached_pages(self) -> int:
        """All pages owned by the cache, locked or not."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Drop everything (nothing may be locked); returns every page the cache owned."""

    def check_invariants(self) -> None:
        """Recount internal state from scratch and assert it matches (tests, idle checks)."""


PrefixCacheCreator = Callable[[int], BasePrefixCache]
PREFIX_CACHES: Registry[PrefixCacheCreator] = Registry("prefix cache")


def create_prefix_cache(name: str, page_size: int) -> BasePrefixCache:
    """Build a registered prefix cache; ValueError naming the valid choices if `name` is unknown."""
    return PREFIX_CACHES.get(name)(page_size)


class NaivePrefixCache(BasePrefixCache):
    """No reuse: never matches and never takes pages, so requests free all of their own pages.
    It lets the scheduler run one code path whether prefix caching is on or off."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._root = CacheHandle()

    @property
    def root(self) -> CacheHandle:
        return self._root

    def match(self, token_ids: Sequence[int], namespace: int = 0) -> MatchResult:
        return MatchResult(self._root, [])

    def lock(self, handle: CacheHandle) -> None:
        assert handle is self._root, "handle does not belong to this cache"

    def unlock(self, handle: CacheHandle) -> None:
        assert handle is self._root, "handle does not belong to this cache"

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], namespace: int = 0) -> InsertResult:
        assert len(token_ids) == len(pages) * self.page_size, "insert whole pages only"
        return InsertResult(self._root, [], [])

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0

    def reset(self) -> list[int]:
        return []


@PREFIX_CACHES.register("naive")
def _create_naive(page_size: int) -> BasePrefixCache:
    return NaivePrefixCache(page_size)
