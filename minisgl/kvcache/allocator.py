"""Page allocator for the paged KV cache: hands out page ids 0..num_pages-1.

Pure bookkeeping, no tensors: the KV pool owns the memory, the scheduler owns the page lists.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        # Free list used as a stack, filled high-to-low so a fresh allocator hands out 0, 1, 2...
        # and recently freed pages are reused first (their KV lines are likely still cached).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        # One byte per page makes double-free / foreign-page checks O(1) per page.
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Return `n` distinct pages, or None (allocating nothing) if fewer than `n` are free."""
        assert n >= 0, f"cannot allocate {n} pages"
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()  # pop order: lowest ids first on a fresh allocator
        in_use = self._in_use
        for page in pages:
            in_use[page] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        in_use = self._in_use
        free_list = self._free
        for page in pages:
            assert 0 <= page < self.num_pages, f"page {page} out of range [0, {self.num_pages})"
            assert in_use[page], f"double free of page {page}"
            in_use[page] = 0
            free_list.append(page)

    def is_free(self, page: int) -> bool:
        assert 0 <= page < self.num_pages, f"page {page} out of range [0, {self.num_pages})"
        return not self._in_use[page]
