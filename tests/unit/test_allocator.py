from __future__ import annotations

import pytest

from minisgl.kvcache import PageAllocator


def test_fresh_allocator_hands_out_low_ids_first() -> None:
    alloc = PageAllocator(8)
    assert alloc.num_pages == 8 and alloc.num_free == 8
    assert alloc.alloc(3) == [0, 1, 2]
    assert alloc.alloc(2) == [3, 4]
    assert alloc.num_free == 3 and alloc.num_used == 5


def test_alloc_zero_is_empty_and_changes_nothing() -> None:
    alloc = PageAllocator(2)
    assert alloc.alloc(0) == []
    assert alloc.num_free == 2
    assert PageAllocator(0).alloc(0) == []


def test_exhaustion_returns_none_and_allocates_nothing() -> None:
    alloc = PageAllocator(4)
    first = alloc.alloc(3)
    assert first is not None
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1  # the failed request took nothing
    assert alloc.alloc(1) == [3]
    assert alloc.alloc(1) is None
    alloc.free(first)
    assert alloc.num_free == 3


def test_free_then_reuse_and_no_page_given_twice() -> None:
    alloc = PageAllocator(6)
    pages = alloc.alloc(6)
    assert pages is not None and sorted(pages) == list(range(6))
    alloc.free([4, 1])
    again = alloc.alloc(2)
    assert again is not None and sorted(again) == [1, 4]
    assert not any(alloc.is_free(page) for page in range(6))


def test_double_free_asserts() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([pages[0]])


def test_duplicate_within_one_free_call_asserts() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(2) == [0, 1]
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([1, 1])


def test_freeing_a_never_allocated_page_asserts() -> None:
    alloc = PageAllocator(4)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([2])


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_out_of_range_free_asserts(page: int) -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(4) is not None
    with pytest.raises(AssertionError, match="out of range"):
        alloc.free([page])


def test_negative_sizes_rejected() -> None:
    with pytest.raises(ValueError):
        PageAllocator(-1)
    with pytest.raises(AssertionError):
        PageAllocator(2).alloc(-1)
