"""The draft-model proposer: a small model with the target's vocabulary proposes K tokens greedily.

It runs a second `Engine` (its own model, KV pool and token table) through the same `StepPlan`
interface, with its own `PageManager` (no prefix cache). Each speculating request has a mirror
`Req` on the draft side whose KV follows the target's committed tokens: a proposal first computes
the committed tokens the mirror has not seen (one extend row per request, batched), which samples
the first proposal, then decodes the rest one batched step at a time, each step built while the
one before runs (its tokens read on the device, as overlap scheduling does). After verification the
mirror keeps the KV of its tokens that were committed (the accepted proposals) and drops the rest,
so each round only computes what is new.
"""

from __future__ import annotations

from minisgl.core import Req, SamplingParams
from minisgl.engine.step import StepPlan
from minisgl.scheduler.engine_api import LaunchedStepLike, SchedulerEngine
from minisgl.scheduler.pages import PageManager, pages_for, slots_of

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b`, known to be at least `start`."""
    end = min(len(a), len(b))
    i = min(start, end)
    while i < end and a[i] == b[i]:
        i += 1
    return i


class DraftProposer:
    def __init__(self, engine: SchedulerEngine, target_vocab: int, max_running: int) -> None:
        if engine.model_config.vocab_size != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({engine.model_config.vocab_size} tokens) differs from "
                             f"the target's ({target_vocab}): speculative decoding needs the same tokenizer")  # fmt: skip
        self.engine = engine
        self.pages = PageManager(engine.pool.num_pages, engine.pool.page_size, "naive", max_running)
        self.context_len = engine.context_len
        self.mirrors: dict[int, Req] = {}

    def propose(self, reqs: list[tuple[Req, int]]) -> dict[int, list[int]]:
        live: list[tuple[Req, int]] = []
        for req, limit in reqs:
            limit = min(limit, self.context_len - req.total_len)
            mirror = self._sync(req, limit) if limit > 0 else None
            if mirror is not None:
                live.append((mirror, limit))
        drafts: dict[int, list[int]] = {mirror.rid: [] for mirror, _ in live}
        counts = dict.fromkeys(drafts, 0)
        # Step 1 computes every mirror's unseen committed tokens; later steps decode one token each,
        # built while the step before runs (its tokens read on the device: `StepPlan.from_prev`),
        # whose tokens are read back once the next is launched (as the scheduler's overlap does).
        inflight: tuple[LaunchedStepLike, list[tuple[Req, int]]] | None = None
        while live:
            plan = self._plan([mirror for mirror, _ in live], inflight[1] if inflight else [])
            step = self.engine.launch(plan, inflight[0] if inflight else None)
            marks: list[tuple[Req, int]] = []
            still: list[tuple[Req, int]] = []
            for mirror, limit in live:
                mirror.cached_len += mirror.extend_len
                mirror.extend_len = 0
                marks.append((mirror, len(mirror.output_ids)))
                mirror.output_ids.append(0)  # placeholder, filled in by _read
                counts[mirror.rid] += 1
                if counts[mirror.rid] < limit:
                    still.append((mirror, limit))
            if inflight is not None:
                self._read(*inflight, drafts)
            inflight = (step, marks)
            live = still
        if inflight is not None:
            self._read(*inflight, drafts)
        return drafts

    @staticmethod
    def _read(step: LaunchedStepLike, marks: list[tuple[Req, int]], drafts: dict[int, list[int]]) -> None:
        """A completed draft step's tokens into its mirrors' placeholders and the proposals."""
        for (mirror, index), token in zip(marks, step.result()):
            mirror.output_ids[index] = token
            drafts[mirror.rid].append(token)

    def _sync(self, req: Req, limit: int) -> Req | None:
        """The request's mirror, its KV cut back to the committed tokens it holds and pages for
        the committed tokens it lacks plus `limit - 1` proposals; None when the draft pool is full."""
        mirror = self.mirrors.get(req.rid)
        if mirror is None:
            if not self.pages.free_rows:
                return None
            mirror = Req(req.rid, req.prompt_ids, _GREEDY)
            self.pages.attach(mirror, self.pages.no_match())
            self.mirrors[req.rid] = mirror
        # The mirror's outputs: the committed ones it proposed or saw, then rejected proposals.
        same = common_prefix(mirror.output_ids, req.output_ids)
        # (At most up to the newest committed token: its KV is computed with the others.)
        mirror.cached_len = min(mirror.cached_len, len(req.prompt_ids) + same, req.total_len - 1)
        mirror.output_ids = list(req.output_ids)
        need = req.total_len - mirror.cached_len + limit - 1
        if not self.pages.reserve(mirror, need):
            self._trim(mirror)
            return None
        mirror.extend_len = req.total_len - mirror.cached_len
        return mirror

    def _plan(self, mirrors: list[Req], pending: list[tuple[Req, int]]) -> StepPlan:
        """The step of `mirrors`; `pending`: the marks of the step in flight, whose tokens are the
        newest inputs of the mirrors that decode (read on the device)."""
        ps = self.pages.page_size
        out_loc: list[int] = []
        from_prev: list[tuple[int, int]] = []
        in_flight = {id(mirror): j for j, (mirror, _) in enumerate(pending)}
        for mirror in mirrors:
            if not mirror.extend_len:
                mirror.extend_len = 1  # a decode step: its newest proposal
                from_prev.append((len(out_loc), in_flight[id(mirror)]))
            out_loc.extend(slots_of(mirror.pages, ps, mirror.cached_len, mirror.cached_len + mirror.extend_len))
        return StepPlan(mirrors, out_loc, from_prev=from_prev, controls=False)

    def _trim(self, mirror: Req) -> None:
        """Pages past the mirror's valid KV go back to the draft pool."""
        keep = pages_for(mirror.cached_len + 1, self.pages.page_size)
        if len(mirror.pages) > keep:
            self.pages.allocator.free(mirror.pages[keep:])
            del mirror.pages[keep:]

    def forget(self, req: Req) -> None:
        mirror = self.mirrors.pop(req.rid, None)
        if mirror is not None:
            self.pages.release(mirror)

    def check_idle(self) -> None:
        assert not self.mirrors, f"{len(self.mirrors)} draft mirrors outlived their requests"
        self.pages.check_idle()
