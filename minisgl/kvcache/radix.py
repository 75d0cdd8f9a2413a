"""Radix-tree prefix cache at page granularity.

Each edge holds a run of whole pages: `key` is its token ids (a multiple of `page_size` long) and
`pages` the KV pages holding them. Children are keyed by their first page's tokens, so one dict
lookup picks the only edge that can continue a prefix. A node is split at a page boundary when a
match or insert stops inside its edge, so every handle ends exactly where its prefix ends.

Eviction uses a lazy min-heap of (last_access, uid, node): entries are pushed whenever a node
becomes (or is refreshed as) an unlocked leaf, and are checked when popped instead of being
removed on every state change. That keeps `match` free of heap work beyond one push, and makes
`evict(k)` cost O(k log n) rather than a scan of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from minisgl.kvcache.prefix_cache import PREFIX_CACHES, BasePrefixCache, CacheHandle, InsertResult, MatchResult

_Key = tuple[int, ...]


@dataclass(slots=True, eq=False)
class _RadixNode(CacheHandle):
    key: _Key
    pages: list[int]
    parent: _RadixNode | None = field(repr=False)  # None for the root and for evicted nodes
    uid: int  # tie-breaker in the heap, so nodes themselves are never compared
    children: dict[_Key, _RadixNode] = field(default_factory=dict, repr=False)
    # Locks held on this node or any descendant: a node is evictable only at ref 0.
    ref: int = 0
    last_access: int = 0
    is_root: bool = False  # the root of a namespace (never evicted, never locked)


class RadixPrefixCache(BasePrefixCache):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._uids = itertools.count()
        self._root = _RadixNode((), [], None, next(self._uids), is_root=True)
        # One tree per namespace (0: the base model; a LoRA adapter's uid otherwise): prefixes
        # computed under one adapter are never matched under another.
        self._roots: dict[int, _RadixNode] = {0: self._root}
        self._clock = 0  # logical LRU time: deterministic, unlike wall time
        self._cached = 0
        self._evictable = 0
        self._num_nodes = 0  # excluding the root; bounds the lazy heap's size
        self._heap: list[tuple[int, int, _RadixNode]] = []

    # ---- queries --------------------------------------------------------------------------

    @property
    def root(self) -> CacheHandle:
        return self._root

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def cached_pages(self) -> int:
        return self._cached

    def match(self, token_ids: Sequence[int], namespace: int = 0) -> MatchResult:
        """Longest cached whole-page prefix. The pages are safe only once `lock(handle)` is
        called: lock before any `evict`, which may otherwise release them."""
        node, pages = self._walk(tuple(token_ids), self._root_of(namespace))
        if not node.is_root:
            self._touch(node)
        return MatchResult(node, pages)

    # ---- locking --------------------------------------------------------------------------

    def lock(self, handle: CacheHandle) -> None:
        node = self._as_node(handle)
        while not node.is_root:
            if node.ref == 0:
                self._evictable -= len(node.pages)
            node.ref += 1
            parent = node.parent
            assert parent is not None, "locking a handle that was evicted or reset"
            node = parent

    def unlock(self, handle: CacheHandle) -> None:
        node = self._as_node(handle)
        while not node.is_root:
            assert node.ref > 0, "unlock without a matching lock"
            node.ref -= 1
            if node.ref == 0:
                self._evictable += len(node.pages)
                if not node.children:
                    self._push(node)
            parent = node.parent
            assert parent is not None, "unlocking a handle that was evicted or reset"
            node = parent

    # ---- mutation -------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], namespace: int = 0) -> InsertResult:
        page_size = self.page_size
        assert len(token_ids) == len(pages) * page_size, "insert whole pages only"
        tokens = tuple(token_ids)
        node, cached = self._walk(tokens, self._root_of(namespace))
        # Pages already in the tree win; the caller's copies of them are duplicates to free.
        to_free = [mine for mine, kept in zip(pages, cached) if mine != kept]
        pos = len(cached) * page_size
        if pos < len(tokens):
            new_pages = list(pages[len(cached) :])
            leaf = _RadixNode(tokens[pos:], new_pages, node, next(self._uids))
            node.children[tokens[pos : pos + page_size]] = leaf
            self._num_nodes += 1
            self._cached += len(new_pages)
            self._evictable += len(new_pages)  # unlocked until the caller locks the handle
            node = leaf
            cached.extend(new_pages)
        if not node.is_root:
            self._touch(node)
        return InsertResult(node, cached, to_free)

    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        heap = self._heap
        page_size = self.page_size
        while len(freed) < num_pages and heap:
            stamp, _, node = heapq.heappop(heap)
            parent = node.parent
            if parent is None or node.children or node.ref or node.last_access != stamp:
                continue  # stale entry: evicted, grew children, locked, or touched since
            del parent.children[node.key[:page_size]]
            node.parent = None
            freed.extend(node.pages)
            self._cached -= len(node.pages)
            self._evictable -= len(node.pages)
            self._num_nodes -= 1
            if not parent.is_root and not parent.children and parent.ref == 0:
                self._push(parent)
        return freed

    def reset(self) -> list[int]:
        assert self._evictable == self._cached, "reset while prefixes are locked"
        pages: list[int] = []
        stack = self._top_nodes()
        while stack:
            node = stack.pop()
            pages.extend(node.pages)
            stack.extend(node.children.values())
            node.parent = None  # stale handles now fail lock/unlock asserts
        self._root.children = {}
        self._roots = {0: self._root}
        self._cached = self._evictable = self._num_nodes = 0
        self._heap = []
        return pages

    # ---- internals ------------------------------------------------------------------------

    def _as_node(self, handle: CacheHandle) -> _RadixNode:
        assert isinstance(handle, _RadixNode), "handle does not belong to a radix cache"
        return handle

    def _root_of(self, namespace: int) -> _RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _RadixNode((), [], None, next(self._uids), is_root=True)
        return root

    def _top_nodes(self) -> list[_RadixNode]:
        """The children of every namespace's root."""
        return [child for root in self._roots.values() for child in root.children.values()]

    def _walk(self, tokens: _Key, root: _RadixNode) -> tuple[_RadixNode, list[int]]:
        """Follow `tokens` down whole pages from `root`, splitting the last edge if the match
        ends inside it. Returns the node ending the matched prefix and that prefix's pages."""
        page_size = self.page_size
        end = len(tokens) - len(tokens) % page_size
        node = root
        pages: list[int] = []
        pos = 0
        while pos < end:
            child = node.children.get(tokens[pos : pos + page_size])
            if child is None:
                break
            key = child.key
            stop = pos + len(key)
            if stop <= end and tokens[pos:stop] == key:
                pages.extend(child.pages)
                node, pos = child, stop
                continue
            # Diverges (or runs out) inside this edge. Binary search on whole pages: slice
            # compares run in C, so O(log n) of them beat a Python loop over pages on long edges.
            lo = 1  # pages known to match (the first one, via the dict lookup)
            hi = min(len(key), end - pos) // page_size  # pages that could match
            while lo < hi:
                mid = (lo + hi + 1) // 2
                start, stop = lo * page_size, mid * page_size
                if key[start:stop] == tokens[pos + start : pos + stop]:
                    lo = mid
                else:
                    hi = mid - 1
            node = self._split(child, lo)
            pages.extend(node.pages)
            break
        return node, pages

    def _split(self, child: _RadixNode, num_pages: int) -> _RadixNode:
        """Cut `child`'s edge after `num_pages` pages; returns the new upper node."""
        page_size = self.page_size
        cut = num_pages * page_size
        parent = child.parent
        assert parent is not None and 0 < num_pages < len(child.pages)
        # The upper half inherits ref and time: every lock through `child` also runs through it,
        # and the page counts (cached / evictable) do not change.
        upper = _RadixNode(
            child.key[:cut],
            child.pages[:num_pages],
            parent,
            next(self._uids),
            ref=child.ref,
            last_access=child.last_access,
        )
        child.key = child.key[cut:]
        child.pages = child.pages[num_pages:]
        child.parent = upper
        upper.children[child.key[:page_size]] = child
        parent.children[upper.key[:page_size]] = upper
        self._num_nodes += 1
        return upper

    def _touch(self, node: _RadixNode) -> None:
        self._clock += 1
        now = self._clock
        walk: _RadixNode | None = node
        while walk is not None and not walk.is_root:
            walk.last_access = now
            walk = walk.parent
        if not node.children and node.ref == 0:
            self._push(node)

    def _push(self, node: _RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.uid, node))
        # Stale entries pile up (every touch of an unlocked leaf adds one); rebuild once they
        # outnumber live nodes, which keeps the heap O(nodes) at amortised O(1) per push.
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [(n.last_access, n.uid, n) for n in self._iter_nodes() if _is_evictable_leaf(n)]
            heapq.heapify(self._heap)

    def _iter_nodes(self) -> list[_RadixNode]:
        out: list[_RadixNode] = []
        stack = self._top_nodes()
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        page_size = self.page_size
        cached = evictable = 0
        seen: set[int] = set()
        nodes = self._iter_nodes()
        for node in [*self._roots.values(), *nodes]:
            child_refs = 0
            for first, child in node.children.items():
                assert child.parent is node, "broken parent link"
                assert first == child.key[:page_size], "child keyed by the wrong page"
                child_refs += child.ref
            if node.is_root:
                continue  # locks never count on a root: it cannot be evicted anyway
            assert node.ref >= child_refs, "a lock below a node must also count on the node"
            assert node.pages and len(node.key) == len(node.pages) * page_size
            assert seen.isdisjoint(node.pages), "a page is cached twice"
            seen.update(node.pages)
            cached += len(node.pages)
            if node.ref == 0:
                evictable += len(node.pages)
        assert cached == self._cached, f"cached_pages {self._cached} != recount {cached}"
        assert evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}"
        assert len(nodes) == self._num_nodes
        live = {uid for stamp, uid, node in self._heap if node.last_access == stamp}
        for node in nodes:
            if _is_evictable_leaf(node):
                assert node.uid in live, "an evictable leaf is missing from the eviction heap"


def _is_evictable_leaf(node: _RadixNode) -> bool:
    return node.parent is not None and not node.children and node.ref == 0


# Registered here (the package imports this module), so prefix_cache.py never imports radix.py back.
@PREFIX_CACHES.register("radix")
def _create_radix(page_size: int) -> BasePrefixCache:
    return RadixPrefixCache(page_size)
