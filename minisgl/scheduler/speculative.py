"""Speculative decoding, the scheduler's side: proposals, acceptance, KV roll-back.

A decoding request that speculates computes its last committed token plus up to K proposed
tokens in one verify row (`StepPlan.drafts`); the engine samples the target's token at every one
of those K + 1 positions with the request's own sampler (`engine/speculative.py`). Proposals
are deterministic (n-gram lookup, or a draft model decoding greedily), so "sample the target at
position i, accept the proposal if it is that sample" is exactly rejection sampling: the proposal
d is kept with probability p(d), and a rejection's sample is distributed as p with d removed and
renormalized, the residual (p - onehot(d))+. The committed tokens are the accepted proposals plus
the target's token after them (the correction or the bonus), so the output keeps the target's
distribution, and under greedy sampling is the token ids of decoding without speculation.

KV of rejected positions is dropped: `cached_len` stays at the committed tokens, pages past them
go back to the allocator, and the prefix cache only ever sees committed tokens (a verify row is
not a prefill, so nothing is inserted at launch).
"""

from __future__ import annotations

from array import array
from collections.abc import Container
from dataclasses import dataclass
from typing import Protocol

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.pages import PageManager, pages_for

_ID_BYTES = array("i").itemsize  # token ids as C ints (every vocabulary fits)


class Proposer(Protocol):
    def propose(self, reqs: list[tuple[Req, int]]) -> dict[int, list[int]]:
        """Per rid, up to `limit` proposed tokens continuing each (req, limit) (or none)."""
        ...

    def forget(self, req: Req) -> None:
        """The request left (its proposer state, if any, goes)."""
        ...

    def check_idle(self) -> None:
        """With no request resident, the proposer holds nothing."""
        ...


def ngram_proposal(ids: list[int], limit: int, max_n: int, min_n: int) -> list[int]:
    """Up to `limit` tokens following the latest earlier occurrence of the last n tokens of
    `ids`, trying n from `max_n` down to `min_n` (prompt lookup); [] when none occurs.

    The search runs over the ids' int32 bytes (`bytes.rfind`, C speed: a Python scan of a 2k-token
    context without a match costs ~1-2 ms a step); a hit off a token boundary is skipped."""
    size = len(ids)
    if size < 2 or limit <= 0:
        return []
    data = array("i", ids).tobytes()
    width = _ID_BYTES
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = data[(size - n) * width :]
        # An occurrence ends before the tail's last token: it lies in ids[: size - 1].
        end = (size - 1) * width
        at = data.rfind(tail, 0, end)
        while at > 0 and at % width:
            end = at + len(tail) - 1  # the next candidate starts before this one
            at = data.rfind(tail, 0, end)
        if at >= 0:
            follow = at // width + n
            return ids[follow : follow + limit]
    return []


class NgramProposer:
    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, reqs: list[tuple[Req, int]]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for req, limit in reqs:
            drafts = ngram_proposal(req.all_ids, limit, self.max_n, self.min_n)
            if drafts:
                out[req.rid] = drafts
        return out

    def forget(self, req: Req) -> None:
        pass

    def check_idle(self) -> None:
        pass


def can_speculate(sampling: SamplingParams) -> bool:
    """Whether a request's sampling is position-independent enough to verify several positions in
    one pass: penalties count the tokens before each position and logprobs are reported per
    sampled row, so requests using them (or a grammar: the caller checks) decode one token a step."""
    return (
        sampling.logprobs is None and sampling.repetition_penalty == 1.0
        and not sampling.frequency_penalty and not sampling.presence_penalty
    )  # fmt: skip


@dataclass(slots=True)
class SpecStats:
    """Counters since start: verify rows, tokens proposed in them, proposals accepted."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens committed per verify row (accepted proposals + the target's own token)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


class SpeculativeDecoder:
    """Picks the decoding requests that speculate, reserves their pages, and accepts results."""

    def __init__(self, config: SchedulerConfig, pages: PageManager, proposer: Proposer) -> None:
        self.k = config.num_speculative_tokens
        self.pages = pages
        self.proposer = proposer
        self.stats = SpecStats()

    def propose(self, decodes: list[Req], grammars: Container[int]) -> dict[int, list[int]]:
        """Proposals of this step's decoding requests (each with pages for its verify row)."""
        wanted: list[tuple[Req, int]] = []
        for req in decodes:
            if req.extend_len != 1 or req.uncomputed_len != 1 or req.rid in grammars:
                continue
            if not can_speculate(req.sampling):
                continue
            # Never past max_tokens or the context: the last proposal's successor must still fit.
            limit = min(self.k, req.sampling.max_tokens - req.output_len - 1, req.max_total_len - req.total_len - 1)
            if limit > 0:
                wanted.append((req, limit))
        if not wanted:
            return {}
        drafts = self.proposer.propose(wanted)
        by_rid = {req.rid: req for req, _ in wanted}
        reserve = self.pages.reserve
        # Without pages for the whole row the request decodes plainly (reserve allocates nothing then).
        return {rid: d for rid, d in drafts.items() if reserve(by_rid[rid], 1 + len(d))}

    def accept(self, drafts: list[int], targets: list[int]) -> list[int]:
        """The committed tokens of a verify row: the proposals equal to the target's token at their
        position, up to the first that is not, then the target's token there (len(targets) ==
        len(drafts) + 1: the last is the bonus after all proposals)."""
        accepted = 0
        for draft, target in zip(drafts, targets):
            if draft != target:
                break
            accepted += 1
        stats = self.stats
        stats.verify_steps += 1
        stats.draft_tokens += len(drafts)
        stats.accepted_tokens += accepted
        return targets[: accepted + 1]

    def roll_back(self, req: Req) -> None:
        """After a committed verify row: KV is valid for every committed token but the newest
        (computed next step); pages past it go back to the allocator."""
        req.cached_len = req.total_len - 1
        keep = pages_for(req.cached_len + 1, self.pages.page_size)
        if len(req.pages) > keep:
            assert keep >= req.shared_pages
            self.pages.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    def forget(self, req: Req) -> None:
        self.proposer.forget(req)

    def check_idle(self) -> None:
        self.proposer.check_idle()
