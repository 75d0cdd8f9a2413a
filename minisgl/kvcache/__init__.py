"""KV cache bookkeeping: page allocator and prefix caches (pure Python, no torch)."""

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.prefix_cache import (
    PREFIX_CACHES,
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    MatchResult,
    NaivePrefixCache,
    create_prefix_cache,
)
from minisgl.kvcache.radix import RadixPrefixCache

__all__ = [
    "PREFIX_CACHES",
    "BasePrefixCache",
    "CacheHandle",
    "InsertResult",
    "MatchResult",
    "NaivePrefixCache",
    "PageAllocator",
    "RadixPrefixCache",
    "create_prefix_cache",
]
