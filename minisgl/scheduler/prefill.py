"""Prefill planning: which prompt tokens a step computes, within the prefill token budget.

First the resident requests still filling their prompt take their next chunk, in admission
order; then waiting requests are admitted from the front of the queue while the budget, rows
and pages last. Admission matches the prompt in the prefix cache and locks the match; it waits
(ending admission for this step) when the pool could not keep the running requests' decode
reserve, or when a resident request is about to compute and cache the next page of its prefix.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from minisgl.core import Req
from minisgl.scheduler.decode import DecodeSet, Retract
from minisgl.scheduler.pages import PageManager, namespace_of, pages_for


class PrefillPlanner:
    def __init__(
        self, pages: PageManager, decode: DecodeSet, *, budget: int, decode_reserve_tokens: int, dedupe: bool
    ) -> None:
        self.pages = pages
        self.decode = decode
        self.budget = budget  # prefill tokens per step (decodes are not counted)
        self.decode_reserve_tokens = decode_reserve_tokens
        # Waiting for a resident request to compute a shared prefix (only pays when it is cached).
        self.dedupe = dedupe
        self.waiting: deque[Req] = deque()
        self._arrival = itertools.count()
        # With LoRA: pins the adapter's device slot for a request being admitted (False: none free).
        self.lora_slot: Callable[[int], bool] | None = None

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request: first in line again."""
        self.waiting.appendleft(req)

    def remove(self, req: Req) -> None:
        self.waiting.remove(req)

    def plan(self, chosen: list[Req], retract: Retract) -> bool:
        """Append this step's prefill chunks to `chosen` (`extend_len` set); returns whether a
        resident request could not get pages for its chunk (starved)."""
        pages, running, waiting = self.pages, self.decode.running, self.waiting
        starved = False
        budget = self.budget
        # 1. Prefill chunks of resident requests.
        for req in running:
            if budget <= 0:
                break
            if req.uncomputed_len > 1 and req.extend_len == 0:
                chunk = min(req.uncomputed_len, budget)
                if pages.reserve(req, chunk):
                    req.extend_len = chunk
                    budget -= chunk
                    chosen.append(req)
                else:
                    starved = True
        # 2. Admission. Resident requests with prompt pages still to compute (what an admission
        # may wait for).
        dedupe = self.dedupe
        prefilling = [r for r in running if r.uncomputed_len > 1 and not r.long_rope] if dedupe and waiting else []
        while budget > 0 and waiting and pages.free_rows:
            req = waiting[0]
            if req.num_pending or not self.admit(req, prefilling):
                break
            waiting.popleft()
            chunk = min(req.uncomputed_len, budget)
            if not pages.reserve(req, chunk):
                retract(req)
                break
            req.extend_len = chunk
            budget -= chunk
            chosen.append(req)
            if dedupe and req.uncomputed_len > 1 and not req.long_rope:
                prefilling.append(req)
        return starved

    def admit(self, req: Req, prefilling: list[Req] | None = None) -> bool:
        """Give `req` a row and its cached prefix, if the pool can take it with room for decodes.

        It waits instead (returns False) while one of `prefilling` is computing its next page."""
        pages = self.pages
        ps = pages.page_size
        ids = req.all_ids
        if req.sampling.prompt_logprobs is not None or req.long_rope:
            # Every prompt position needs its logits; or its KV is rotated unlike the cache's.
            match = pages.no_match()
        else:
            # At least one token must be computed to produce logits.
            match = pages.match(ids[: req.total_len - 1], namespace_of(req))
            if prefilling and self._shares_pending_prefill(req, ids, len(match.pages), prefilling):
                return False
        uncached = req.total_len - len(match.pages) * ps
        reserve_tokens = self.decode_reserve_tokens
        need = pages_for(uncached + min(req.sampling.max_tokens - req.output_len, reserve_tokens), ps)
        reserve = self.decode.growth_pages(reserve_tokens)
        # Lock first so the matched pages no longer count as evictable room.
        pages.lock(match)
        if need + reserve > pages.room and self.decode.running:
            pages.unlock(match)
            return False
        if req.lora_id is not None and self.lora_slot is not None and not self.lora_slot(req.lora_id):
            pages.unlock(match)  # every adapter slot is pinned by resident requests: wait
            return False
        pages.attach(req, match)
        if req.arrival == 0 and req.output_len == 0:
            req.prefix_len = req.cached_len  # the first admission's cache hit is what is reported
        req.arrival = next(self._arrival) + 1
        self.decode.add(req)
        return True

    def _shares_pending_prefill(self, req: Req, ids: list[int], matched_pages: int, prefilling: list[Req]) -> bool:
        """Whether a resident request is about to compute (and cache) the next whole page of this
        request's prefix: then waiting for it beats computing it twice (n > 1 samples of one
        prompt, a shared system prompt arriving together). Prefill chunks are shared as soon as
        they are computed, so this waits a step per shared chunk."""
        ps = self.pages.page_size
        begin, end = matched_pages * ps, (matched_pages + 1) * ps
        if end > req.total_len - 1:
            return False  # nothing more this request could take from the cache
        page = ids[begin:end]
        for other in prefilling:
            if other.row is None or other.total_len < end or other.cached_len >= end or other.lora_id != req.lora_id:
                continue  # not prefilling that page
            # The same page, after the same prefix (compared last: the page alone rarely matches).
            if other.token_slice(begin, end) == page and other.token_slice(0, begin) == ids[:begin]:
                return True
        return False
