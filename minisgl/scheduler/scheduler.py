"""Continuous batching over a paged KV cache with a prefix cache, chunked prefill and retraction.

Every `step()` runs one forward: all decoding requests (one token each) plus prefill chunks of
admitted requests within the `max_prefill_tokens` budget. Finished requests leave at once; their
KV goes to the prefix cache (radix) or back to the pool (naive).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, replace

from minisgl.core import FinishReason, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine, LaunchedStep, LogprobEntry, StepPlan
from minisgl.engine.grammar import GrammarBackend, GrammarState, grammar_key
from minisgl.engine.penalties import uses_penalties
from minisgl.kvcache import PageAllocator, create_prefix_cache
from minisgl.kvcache.prefix_cache import MatchResult
from minisgl.message.frontend import SchedulerStats
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class ReqOutput:
    rid: int
    token_ids: list[int]  # tokens generated in this step (0 or 1 today)
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    # Requested with `logprobs`: one (logprob, top alternatives) entry per token in token_ids.
    logprobs: list[LogprobEntry] | None = None
    # Requested with `prompt_logprobs`: one entry per prompt token, sent once with the first
    # output; the first prompt token has nothing to condition on: (None, []).
    prompt_logprobs: list[tuple[float | None, list[tuple[int, float]]]] | None = None


@dataclass
class InFlight:
    """A launched step and, per sampled request, the output index its token will fill."""

    step: LaunchedStep
    marks: list[tuple[Req, int]]
    logprobs: bool = False  # some live request asked for (prompt) logprobs: read them back


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _slots(pages: list[int], page_size: int, begin: int, end: int) -> list[int]:
    """The KV slots of positions [begin, end) of a request holding `pages`, a page at a time."""
    if page_size == 1:
        return pages[begin:end]
    out: list[int] = []
    for i in range(begin // page_size, (end - 1) // page_size + 1):
        base = pages[i] * page_size
        out.extend(range(base + max(begin - i * page_size, 0), base + min(end - i * page_size, page_size)))
    return out


class Scheduler:
    def __init__(
        self,
        engine_config: EngineConfig,
        sched_config: SchedulerConfig,
        engine: Engine | None = None,
    ) -> None:
        self.config = sched_config
        if engine is None:
            engine_config = replace(engine_config, max_running_requests=sched_config.max_running_requests)
            engine = Engine(engine_config)
        self.engine = engine
        self.page_size = engine.pool.page_size
        self.context_len = engine.context_len
        self.eos_ids = frozenset(engine.model_config.eos_ids)
        self.allocator = PageAllocator(engine.pool.num_pages)
        self.cache = create_prefix_cache(sched_config.cache, self.page_size)
        self.max_running = min(sched_config.max_running_requests, engine.config.max_running_requests)
        self.prefill_budget = sched_config.max_prefill_tokens or engine.platform.offline_prefill_tokens()
        self.free_rows = list(range(self.max_running - 1, -1, -1))
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[int, Req] = {}
        self._arrival = itertools.count()
        self._pending_table: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.num_retractions = 0
        # Overlap pays only where the device runs asynchronously to the host.
        overlap = sched_config.overlap
        self.overlap = engine.platform.name == "cuda" if overlap is None else overlap
        self._inflight: InFlight | None = None
        # Per-request state beyond `Req` (by rid): structured-output matchers, prompt logprobs
        # gathered until the first output token, requests wanting logprobs, and requests whose
        # engine-side state (penalty counts) the next plan releases.
        self._grammar_backend: GrammarBackend | None = None
        self.grammars: dict[int, GrammarState] = {}
        self._prompt_logprobs: dict[int, list[LogprobEntry]] = {}
        self._logprob_rids: set[int] = set()
        self._controlled_rids: set[int] = set()  # any logit control, grammar or logprobs
        self._released: list[int] = []
        # Waiting for a resident request to compute a shared prefix only pays when it is kept.
        self._dedupe_prefill = sched_config.dedupe_prefill and sched_config.cache == "radix"

    # ---------------------------------------------------------------- public API
    def add_request(self, rid: int, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if rid in self.reqs:
            raise ValueError(f"request id {rid} is already in use")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, but the model's context length is {self.context_len}"
            )
        vocab = self.engine.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        worst = min(len(prompt_ids) + sampling.max_tokens, self.context_len)
        if _pages_for(worst, self.page_size) > self.allocator.num_pages:
            raise ValueError(
                f"the request needs up to {worst} tokens of KV cache, more than the pool holds "
                f"({self.allocator.num_pages * self.page_size}); raise --num-pages or lower max_tokens"
            )
        for name, ids in (("logit_bias", sampling.logit_bias), ("stop_token_ids", sampling.stop_token_ids)):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise ValueError(f"{name} token ids must be in [0, {vocab})")
        grammar = self._new_grammar(sampling)
        req = Req(rid, list(prompt_ids), sampling, eos_ids=self.eos_ids, max_total_len=self.context_len)
        self.reqs[rid] = req
        self.waiting.append(req)
        if grammar is not None:
            self.grammars[rid] = grammar
        if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            self._logprob_rids.add(rid)
        if (grammar is not None or rid in self._logprob_rids or uses_penalties(sampling) or sampling.logit_bias
                or sampling.min_tokens):
            self._controlled_rids.add(rid)

    def _new_grammar(self, sampling: SamplingParams) -> GrammarState | None:
        if grammar_key(sampling) is None:
            return None
        if self._grammar_backend is None:
            engine = self.engine
            self._grammar_backend = GrammarBackend(engine.model_dir, engine.model_config.vocab_size, sorted(self.eos_ids))
        return self._grammar_backend.new_state(sampling)

    def _forget(self, req: Req) -> None:
        """Drop the per-request state of a request that left (finished or aborted)."""
        rid = req.rid
        self.grammars.pop(rid, None)
        self._prompt_logprobs.pop(rid, None)
        self._logprob_rids.discard(rid)
        self._controlled_rids.discard(rid)
        if uses_penalties(req.sampling):
            self._released.append(rid)

    def abort(self, rid: int) -> bool:
        req = self.reqs.pop(rid, None)
        if req is None:
            return False
        req.finish_reason = "abort"
        self._forget(req)
        if req.row is not None:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            total_pages=self.allocator.num_pages,
            free_pages=self.allocator.num_free,
            cached_pages=self.cache.cached_pages,
            evictable_pages=self.cache.evictable_pages,
            running=len(self.running),
            waiting=len(self.waiting),
        )

    def flush_cache(self) -> None:
        """Drop every cached prefix (only when idle): the pool returns to full."""
        assert not self.running, "flush_cache while requests hold cached pages"
        self.allocator.free(self.cache.reset())

    def check_idle_invariants(self) -> None:
        assert not self.running and len(self.free_rows) == self.max_running
        held = self.allocator.num_free + self.cache.cached_pages
        assert held == self.allocator.num_pages, f"page leak: {held} of {self.allocator.num_pages} accounted"
        assert self.cache.evictable_pages == self.cache.cached_pages, "a cache lock outlived its request"

    # ---------------------------------------------------------------- one step
    def step(self) -> list[ReqOutput]:
        """Plan and launch one step; return the outputs of the step that completed.

        Without overlap that is this step. With overlap (CUDA), the step launched last time
        completes while this one runs, so the host plans step N+1 while the GPU computes step N;
        inputs not yet known on the host are read on the device (`StepPlan.from_prev`)."""
        plan = self._plan()
        launched: InFlight | None = None
        if plan is not None:
            step = self.engine.launch(plan, self._inflight.step if self._inflight else None)
            launched = InFlight(step, self._advance(plan, step.sampled_reqs), bool(self._logprob_rids))
        outputs: list[ReqOutput] = []
        if self.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                outputs = self._complete(previous)
        elif launched is not None:
            outputs = self._complete(launched)
        if not self.running and self._inflight is None:
            self.check_idle_invariants()
        return outputs

    def _advance(self, plan: StepPlan, sampled: list[Req]) -> list[tuple[Req, int]]:
        """Account for a launched step before its tokens are known: KV is computed, and each
        sampling request holds a placeholder output token until `_complete`."""
        prefilled = [req for req in plan.reqs if req.extend_len > 1]
        for req in plan.reqs:
            req.cached_len += req.extend_len
            req.extend_len = 0
        marks = []
        for req in sampled:
            req.output_ids.append(0)  # placeholder, filled in by _complete
            req.num_pending += 1
            marks.append((req, req.output_len - 1))
        for req in prefilled:
            # Share a prefill (chunk) at once: concurrent requests with the same prefix (a system
            # prompt, n > 1 samples) then match it instead of computing it again.
            self._cache_prefix(req)
        return marks

    def _complete(self, inflight: "InFlight") -> list[ReqOutput]:
        step = inflight.step
        tokens = step.result()
        token_logprobs: list[LogprobEntry | None] | None = None
        if inflight.logprobs:
            self._collect_prompt_logprobs(step)
            token_logprobs = step.token_logprobs()
        grammars = self.grammars
        outputs: list[ReqOutput] = []
        for j, ((req, index), token) in enumerate(zip(inflight.marks, tokens)):
            req.num_pending -= 1
            if req.finished:
                continue  # aborted, or ended by an earlier token while this step was in flight
            req.output_ids[index] = token
            reason = req.finish_reason_at(index)
            if grammars and req.rid in grammars:
                reason = self._accept_grammar(req, grammars[req.rid], token, reason)
            if reason is not None:
                del req.output_ids[index + 1 :]  # tokens sampled after the end are dropped
                req.finish_reason = reason
                self.reqs.pop(req.rid, None)
                if req.row is not None:
                    self.running.remove(req)
                    self._release(req)
                else:
                    self.waiting.remove(req)  # retracted while its last token was in flight
            out = ReqOutput(req.rid, [token], reason, req.prompt_len, req.prefix_len, index + 1)
            if token_logprobs is not None:
                entry = token_logprobs[j]
                out.logprobs = None if entry is None else [entry]
                if index == 0 and req.sampling.prompt_logprobs is not None:
                    out.prompt_logprobs = [(None, []), *self._prompt_logprobs.pop(req.rid, [])]
            if reason is not None:
                self._forget(req)
            outputs.append(out)
        return outputs

    def _accept_grammar(
        self, req: Req, grammar: GrammarState, token: int, reason: FinishReason | None
    ) -> FinishReason | None:
        """Advance the request's matcher; it ends once the grammar accepted a stop token."""
        if not grammar.accept(token):
            # Only reachable if a token was sampled without the request's current mask.
            logger.error("request %s: token %d violates its grammar; ending it", req.rid, token)
            return reason or "stop"
        if grammar.terminated:
            return reason or "stop"
        return reason

    def _collect_prompt_logprobs(self, step: LaunchedStep) -> None:
        """Gather prompt-logprob chunks until the request's first output token is known (a
        recomputation after retraction produces them again; those are dropped)."""
        for chunk, entries in step.prompt_logprob_chunks():
            req = chunk.req
            if req.finished or req.output_len - req.num_pending > 0:
                continue
            gathered = self._prompt_logprobs.setdefault(req.rid, [])
            del gathered[chunk.first - 1 :]
            gathered.extend(entries)

    def _plan(self) -> StepPlan | None:
        while True:
            plan, starved = self._try_plan()
            if plan is not None or not starved:
                return plan
            # Running requests need pages and none could get any: give one back and try again.
            self._retract(max(self.running, key=lambda r: r.arrival))

    def _try_plan(self) -> tuple[StepPlan | None, bool]:
        chosen: list[Req] = []
        starved = False
        # 1. Decodes: one token each; retract the newest requests if their pages run out.
        # (Hot loop: lengths are read off the lists directly rather than through properties.)
        page_tokens = self.page_size
        grammars = self.grammars
        for req in list(self.running):
            total = len(req.prompt_ids) + len(req.output_ids)
            if total - req.cached_len != 1 or req.row is None:  # row None: retracted above
                continue
            if len(req.output_ids) >= req.sampling.max_tokens or total >= req.max_total_len:
                continue  # ends with its in-flight token
            if req.num_pending and grammars and req.rid in grammars:
                continue  # its next mask needs the in-flight token: it decodes every other step
            while req.cached_len >= len(req.pages) * page_tokens and not self._reserve(req, 1):
                victim = max(self.running, key=lambda r: r.arrival)
                self._retract(victim)
                if victim is req:
                    break
            if req.row is not None:
                req.extend_len = 1
                chosen.append(req)
        chosen = [req for req in chosen if req.row is not None]  # drop decodes retracted above
        # 2. Prefill chunks of resident requests, then 3. admission, within the token budget.
        budget = self.prefill_budget
        for req in self.running:
            if budget <= 0:
                break
            if req.uncomputed_len > 1 and req.extend_len == 0:
                chunk = min(req.uncomputed_len, budget)
                if self._reserve(req, chunk):
                    req.extend_len = chunk
                    budget -= chunk
                    chosen.append(req)
                else:
                    starved = True
        # Resident requests with prompt pages still to compute (what an admission may wait for).
        prefilling = [r for r in self.running if r.uncomputed_len > 1] if self._dedupe_prefill and self.waiting else []
        while budget > 0 and self.waiting and self.free_rows:
            req = self.waiting[0]
            if req.num_pending or not self._admit(req, prefilling):
                break
            self.waiting.popleft()
            chunk = min(req.uncomputed_len, budget)
            if not self._reserve(req, chunk):
                self._retract(req)
                break
            req.extend_len = chunk
            budget -= chunk
            chosen.append(req)
            if self._dedupe_prefill and req.uncomputed_len > 1:
                prefilling.append(req)
        if not chosen:
            return None, starved and bool(self.running)
        return self._build_plan(chosen), False

    def _build_plan(self, reqs: list[Req]) -> StepPlan:
        ps = self.page_size
        out_loc: list[int] = []
        rows, pos, slots = self._pending_table
        self._pending_table = ([], [], [])
        pending = {id(req): j for j, (req, _) in enumerate(self._inflight.marks)} if self._inflight else {}
        from_prev: list[tuple[int, int]] = []
        for req in reqs:
            pages = req.pages
            begin = req.cached_len
            end = begin + req.extend_len
            if req.num_pending and end == len(req.prompt_ids) + len(req.output_ids):
                # Its newest input token is still being sampled by the step in flight.
                from_prev.append((len(out_loc) + req.extend_len - 1, pending[id(req)]))
            if end - begin == 1:
                out_loc.append(pages[begin // ps] * ps + begin % ps)
            else:
                out_loc.extend(_slots(pages, ps, begin, end))
        released, self._released = self._released, []
        return StepPlan(reqs, out_loc, rows, pos, slots, from_prev, self.grammars, released, bool(self._controlled_rids))

    # ---------------------------------------------------------------- pages and rows
    def _alloc_pages(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        shortfall = n - self.allocator.num_free
        if shortfall > 0:
            self.allocator.free(self.cache.evict(shortfall))
        return self.allocator.alloc(n)

    def _reserve(self, req: Req, tokens: int) -> bool:
        """Make sure `req` has pages for its next `tokens` tokens."""
        need = _pages_for(req.cached_len + tokens, self.page_size) - len(req.pages)
        pages = self._alloc_pages(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _admit(self, req: Req, prefilling: list[Req] | None = None) -> bool:
        """Give `req` a row and its cached prefix, if the pool can take it with room for decodes.

        It waits instead (returns False) while one of `prefilling` is computing its next page."""
        ps = self.page_size
        ids = req.all_ids
        if req.sampling.prompt_logprobs is not None:
            match = MatchResult(self.cache.root, [])  # every prompt position needs its logits
        else:
            # At least one token must be computed to produce logits.
            match = self.cache.match(ids[: req.total_len - 1])
            if prefilling and self._shares_pending_prefill(req, ids, len(match.pages), prefilling):
                return False
        uncached = req.total_len - len(match.pages) * ps
        need = _pages_for(uncached + min(req.sampling.max_tokens - req.output_len, self.config.decode_reserve_tokens), ps)
        reserve = sum(
            _pages_for(min(r.sampling.max_tokens - r.output_len, self.config.decode_reserve_tokens), ps)
            for r in self.running
        )
        # Lock first so the matched pages no longer count as evictable room.
        self.cache.lock(match.handle)
        available = self.allocator.num_free + self.cache.evictable_pages
        if need + reserve > available and self.running:
            self.cache.unlock(match.handle)
            return False
        req.cache_handle = match.handle
        req.pages = list(match.pages)
        req.shared_pages = len(match.pages)
        req.cached_len = len(match.pages) * ps
        if req.arrival == 0 and req.output_len == 0:
            req.prefix_len = req.cached_len
        req.arrival = next(self._arrival) + 1
        req.row = self.free_rows.pop()
        self.running.append(req)
        if req.cached_len:
            rows, pos, slots = self._pending_table
            rows.extend([req.row] * req.cached_len)
            pos.extend(range(req.cached_len))
            slots.extend(_slots(req.pages, ps, 0, req.cached_len))
        return True

    def _shares_pending_prefill(self, req: Req, ids: list[int], matched_pages: int, prefilling: list[Req]) -> bool:
        """Whether a resident request is about to compute (and cache) the next whole page of this
        request's prefix: then waiting for it beats computing it twice (n > 1 samples of one
        prompt, a shared system prompt arriving together). Prefill chunks are shared as soon as
        they are computed, so this waits a step per shared chunk."""
        ps = self.page_size
        begin, end = matched_pages * ps, (matched_pages + 1) * ps
        if end > req.total_len - 1:
            return False  # nothing more this request could take from the cache
        page = ids[begin:end]
        for other in prefilling:
            if other.row is None or other.total_len < end or other.cached_len >= end:
                continue  # not prefilling that page
            # The same page, after the same prefix (compared last: the page alone rarely matches).
            if other.token_slice(begin, end) == page and other.token_slice(0, begin) == ids[:begin]:
                return True
        return False

    def _cache_prefix(self, req: Req) -> None:
        """Hand the request's whole computed pages to the prefix cache (keeping them locked)."""
        ps = self.page_size
        full = req.cached_len // ps
        if full <= req.shared_pages:
            return
        res = self.cache.insert(req.all_ids[: full * ps], req.pages[:full])
        if not res.pages:
            return  # the cache keeps nothing (naive)
        self.allocator.free(res.pages_to_free)
        rows, pos, slots = self._pending_table
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

    def _release(self, req: Req) -> None:
        """Return everything a resident request holds: pages to the cache or pool, its row."""
        ps = self.page_size
        full = req.cached_len // ps
        if full > req.shared_pages:
            res = self.cache.insert(req.all_ids[: full * ps], req.pages[:full])
            self.allocator.free(res.pages_to_free)
            owned_from = max(len(res.pages), req.shared_pages)
        else:
            owned_from = req.shared_pages
        self.allocator.free(req.pages[owned_from:])
        rows, pos, slots = self._pending_table
        if req.row in rows:  # deferred table entries must not reach the row's next owner
            keep = [i for i, row in enumerate(rows) if row != req.row]
            self._pending_table = ([rows[i] for i in keep], [pos[i] for i in keep], [slots[i] for i in keep])
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        req.pages = []
        req.shared_pages = 0
        assert req.row is not None
        self.free_rows.append(req.row)
        req.row = None

    def _retract(self, req: Req) -> None:
        """Preempt a resident request: keep its tokens, drop its KV (cached for a cheap resume)."""
        self.num_retractions += 1
        logger.debug("retracting request %s at %d tokens", req.rid, req.total_len)
        self.running.remove(req)
        self._release(req)
        req.cached_len = 0
        req.extend_len = 0
        self.waiting.appendleft(req)
