"""The resident requests and their decode growth.

`DecodeSet.running` holds every request with a row and pages, in admission order (prefilling or
decoding). Each step a decoding request computes one token; when that token needs a new page
and none is left, the newest resident request is retracted (its KV dropped, its tokens kept) until
the page fits or the request itself was the newest.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from minisgl.core import Req
from minisgl.engine.grammar import GrammarState
from minisgl.scheduler.pages import PageManager, pages_for

Retract = Callable[[Req], None]

_arrival = attrgetter("arrival")


class DecodeSet:
    def __init__(self, pages: PageManager) -> None:
        self.pages = pages
        self.running: list[Req] = []

    def add(self, req: Req) -> None:
        self.running.append(req)

    def remove(self, req: Req) -> None:
        self.running.remove(req)

    def victim(self) -> Req:
        """The request to retract when pages run out: the newest admitted."""
        return max(self.running, key=_arrival)

    def growth_pages(self, reserve_tokens: int) -> int:
        """Pages kept back for the running requests' next `reserve_tokens` tokens each (capped by
        what each may still generate): an admission must leave them free."""
        ps = self.pages.page_size
        return sum(pages_for(min(r.sampling.max_tokens - r.output_len, reserve_tokens), ps) for r in self.running)

    def plan(self, grammars: dict[int, GrammarState], retract: Retract) -> list[Req]:
        """The requests that decode one token this step (`extend_len` set to 1), each with a
        page for it; `retract` is called on the victims when pages run out.

        A request skips a step when its in-flight token already ends it, or when it is
        constrained by a grammar and its token is still in flight (its next mask needs it)."""
        # Hot loop: lengths are read off the lists directly rather than through properties.
        page_tokens = self.pages.page_size
        reserve = self.pages.reserve
        chosen: list[Req] = []
        for req in list(self.running):
            total = len(req.prompt_ids) + len(req.output_ids)
            if total - req.cached_len != 1 or req.row is None:  # row None: retracted above
                continue
            if len(req.output_ids) >= req.sampling.max_tokens or total >= req.max_total_len:
                continue  # ends with its in-flight token
            if req.num_pending and grammars and req.rid in grammars:
                continue  # its next mask needs the in-flight token: it decodes every other step
            while req.cached_len >= len(req.pages) * page_tokens and not reserve(req, 1):
                victim = self.victim()
                retract(victim)
                if victim is req:
                    break
            if req.row is not None:
                req.extend_len = 1
                chosen.append(req)
        return [req for req in chosen if req.row is not None]  # drop decodes retracted above
