"""Page and row bookkeeping of resident requests: the page allocator, the prefix cache, the
token-table rows, and the token-table entries a page change defers to the next plan.

Every page is owned by exactly one of the allocator (free), the prefix cache, or one request
(`req.pages[req.shared_pages:]`); `req.pages[:req.shared_pages]` are cache-owned pages the request
reads while it holds `req.cache_handle` locked. The table entries are written by the engine before
the next forward: a prefix matched at admission, or a page swapped for the cache's copy.
"""

from __future__ import annotations

from minisgl.core import Req
from minisgl.kvcache import PageAllocator, create_prefix_cache
from minisgl.kvcache.prefix_cache import MatchResult

# Deferred token-table entries: (rows, positions, slots), one entry per position.
TableEntries = tuple[list[int], list[int], list[int]]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


def namespace_of(req: Req) -> int:
    """The prefix-cache namespace of a request: its LoRA adapter's uid, 0 for the base model."""
    return 0 if req.lora_id is None else req.lora_id


def slots_of(pages: list[int], page_size: int, begin: int, end: int) -> list[int]:
    """The KV slots of positions [begin, end) of a request holding `pages`, a page at a time."""
    if page_size == 1:
        return pages[begin:end]
    out: list[int] = []
    for i in range(begin // page_size, (end - 1) // page_size + 1):
        base = pages[i] * page_size
        out.extend(range(base + max(begin - i * page_size, 0), base + min(end - i * page_size, page_size)))
    return out


class PageManager:
    """Owns the KV pages (allocator + prefix cache) and the token-table rows of resident requests."""

    def __init__(self, num_pages: int, page_size: int, cache: str, num_rows: int) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = create_prefix_cache(cache, page_size)
        self.num_rows = num_rows
        self.free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first
        self._table: TableEntries = ([], [], [])

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def room(self) -> int:
        """Pages an allocation can get: free ones plus unlocked cached ones (evicted on demand)."""
        return self.allocator.num_free + self.cache.evictable_pages

    # ------------------------------------------------------------------------ pages
    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, evicting unlocked cached prefixes if the free list is short; None if even
        that is not enough (nothing is allocated then)."""
        if n <= 0:
            return []
        shortfall = n - self.allocator.num_free
        if shortfall > 0:
            self.allocator.free(self.cache.evict(shortfall))
        return self.allocator.alloc(n)

    def reserve(self, req: Req, tokens: int) -> bool:
        """Make sure `req` has pages for its next `tokens` tokens."""
        need = pages_for(req.cached_len + tokens, self.page_size) - len(req.pages)
        pages = self.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    # ------------------------------------------------------------------------ prefix cache
    def match(self, ids: list[int], namespace: int = 0) -> MatchResult:
        """The longest cached whole-page prefix of `ids` (not yet locked) in `namespace`
        (`namespace_of`: prefixes computed under one LoRA adapter stay its own)."""
        return self.cache.match(ids, namespace)

    def no_match(self) -> MatchResult:
        """Nothing from the cache (a request that needs every prompt position computed)."""
        return MatchResult(self.cache.root, [])

    def lock(self, match: MatchResult) -> None:
        self.cache.lock(match.handle)

    def unlock(self, match: MatchResult) -> None:
        self.cache.unlock(match.handle)

    def attach(self, req: Req, match: MatchResult) -> None:
        """Make `req` resident: a row, the (locked) matched prefix as its KV, table entries for it."""
        ps = self.page_size
        req.cache_handle = match.handle
        req.pages = list(match.pages)
        req.shared_pages = len(match.pages)
        req.cached_len = len(match.pages) * ps
        req.row = self.free_rows.pop()
        if req.cached_len:
            rows, pos, slots = self._table
            rows.extend([req.row] * req.cached_len)
            pos.extend(range(req.cached_len))
            slots.extend(slots_of(req.pages, ps, 0, req.cached_len))

    def cache_prefix(self, req: Req) -> None:
        """Hand the request's whole computed pages to the prefix cache (keeping them locked)."""
        ps = self.page_size
        full = req.cached_len // ps
        if full <= req.shared_pages or req.long_rope or req.slid_pages:
            return  # nothing new; KV no other request may read (`Req.long_rope`); or a prefix with holes
        res = self.cache.insert(req.all_ids[: full * ps], req.pages[:full], namespace_of(req))
        if not res.pages:
            return  # the cache keeps nothing (naive)
        self.allocator.free(res.pages_to_free)
        rows, pos, slots = self._table
        for i, page in enumerate(res.pages):
            if page != req.pages[i]:
                req.pages[i] = page  # another request cached this page first: use its copy
                rows.extend([req.row] * ps)  # type: ignore[list-item]
                pos.extend(range(i * ps, (i + 1) * ps))
                slots.extend(range(page * ps, (page + 1) * ps))
        self.cache.lock(res.handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = res.handle
        req.shared_pages = len(res.pages)

    def slide(self, req: Req, window: int) -> None:
        """Return the request's own pages wholly behind the window of its next position: with a
        window on every layer no query reads them again. The prefix cache keeps what it owns;
        the request caches nothing more (its prefix has holes)."""
        ps = self.page_size
        first_read = max(req.cached_len - window + 1, 0) // ps
        start = max(req.shared_pages, req.slid_pages)
        if first_read > start:
            self.allocator.free(req.pages[start:first_read])
            req.slid_pages = first_read

    def release(self, req: Req) -> None:
        """Return everything a resident request holds: pages to the cache or pool, its row."""
        ps = self.page_size
        full = req.cached_len // ps
        if full > req.shared_pages and not req.long_rope and not req.slid_pages:
            res = self.cache.insert(req.all_ids[: full * ps], req.pages[:full], namespace_of(req))
            self.allocator.free(res.pages_to_free)
            owned_from = max(len(res.pages), req.shared_pages)
        else:
            owned_from = max(req.shared_pages, req.slid_pages)
        self.allocator.free(req.pages[owned_from:])
        rows, pos, slots = self._table
        if req.row in rows:  # deferred table entries must not reach the row's next owner
            keep = [i for i, row in enumerate(rows) if row != req.row]
            self._table = ([rows[i] for i in keep], [pos[i] for i in keep], [slots[i] for i in keep])
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        req.pages = []
        req.shared_pages = 0
        req.slid_pages = 0
        assert req.row is not None
        self.free_rows.append(req.row)
        req.row = None

    # ------------------------------------------------------------------------ table, idle
    def take_table(self) -> TableEntries:
        """The deferred token-table entries, handed to the next plan (and cleared here)."""
        table, self._table = self._table, ([], [], [])
        return table

    def flush(self) -> None:
        """Drop every cached prefix: the pool returns to full (only when nothing is resident)."""
        self.allocator.free(self.cache.reset())

    def check_idle(self) -> None:
        """With nothing resident every row is free and every page is free or cached, unlocked."""
        assert len(self.free_rows) == self.num_rows, f"{self.num_rows - len(self.free_rows)} rows still taken"
        held = self.allocator.num_free + self.cache.cached_pages
        assert held == self.allocator.num_pages, f"page leak: {held} of {self.allocator.num_pages} accounted"
        assert self.cache.evictable_pages == self.cache.cached_pages, "a cache lock outlived its request"
