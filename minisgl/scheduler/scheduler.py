"""Continuous batching over a paged KV cache with a prefix cache, chunked prefill and retraction.

Every `step()` runs one forward: all decoding requests (one token each) plus prefill chunks of
admitted requests within the `max_prefill_tokens` budget. Finished requests leave at once; their
KV goes to the prefix cache (radix) or back to the pool (naive).

The scheduler composes its parts and owns the step: `PageManager` (pages, prefix cache, rows),
`DecodeSet` (resident requests, decode growth, retraction victim), `PrefillPlanner` (admission
and chunking) and `RequestControls` (grammars, penalties, logprobs). It is handed its engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minisgl.core import PoolingParams, Req, SamplingParams
from minisgl.engine.step import LogprobEntry, StepPlan
from minisgl.engine.grammar import GrammarBackend
from minisgl.kvcache import BasePrefixCache, PageAllocator
from minisgl.lora.manager import LoraManager, UnknownAdapterError
from minisgl.message.frontend import SchedulerStats
from minisgl.message.tokenizer import TokenOut
from minisgl.scheduler.config import SchedulerConfig, device_runs_async, resolve
from minisgl.scheduler.controls import RequestControls
from minisgl.scheduler.decode import DecodeSet
from minisgl.scheduler.engine_api import LaunchedStepLike, SchedulerEngine
from minisgl.scheduler.pages import PageManager, slots_of
from minisgl.scheduler.prefill import PrefillPlanner
from minisgl.scheduler.speculative import NgramProposer, Proposer, SpecStats, SpeculativeDecoder
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


class TaskError(ValueError):
    """A request the served model cannot run (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class InFlight:
    """A launched step and, per sampled request, the output index its token will fill."""

    step: LaunchedStepLike
    marks: list[tuple[Req, int]]
    logprobs: bool = False  # some live request asked for (prompt) logprobs: read them back
    drafts: dict[int, list[int]] = field(default_factory=dict)  # the step's verify rows (speculation)


class Scheduler:
    def __init__(self, engine: SchedulerEngine, config: SchedulerConfig, proposer: Proposer | None = None) -> None:
        self.engine = engine
        wants_overlap = device_runs_async(engine.platform) if config.overlap is None else config.overlap
        self.config = config = resolve(config, engine.platform)
        assert config.overlap is not None and config.max_prefill_tokens is not None
        self.page_size = engine.pool.page_size
        self.context_len = engine.context_len
        self.vocab_size = engine.model_config.vocab_size
        self.eos_ids = frozenset(engine.model_config.eos_ids)
        self.long_rope_from = engine.model_config.long_rope_from
        self.kv_window = engine.model_config.kv_window
        self.pooler = engine.pooler  # None: the engine generates text; else it serves embeddings only
        self.max_running = min(config.max_running_requests, engine.config.max_running_requests)
        self.pages = PageManager(engine.pool.num_pages, self.page_size, config.cache, self.max_running)
        self.decode = DecodeSet(self.pages)
        self.planner = PrefillPlanner(
            self.pages, self.decode, budget=config.max_prefill_tokens,
            decode_reserve_tokens=config.decode_reserve_tokens,
            dedupe=config.dedupe_prefill and config.cache == "radix",
        )
        self.controls = RequestControls(self._grammar_backend)
        # LoRA adapters (lora/manager.py), or None: the engine serves its base model only.
        self.lora: LoraManager | None = getattr(engine, "lora", None)
        if self.lora is not None:
            self.planner.lora_slot = self.lora.acquire
        self.spec = self._speculative(config, proposer)
        self.reqs: dict[int, Req] = {}
        self.num_retractions = 0
        self.overlap = config.overlap  # pays only where the device runs asynchronously to the host
        # Speculation where overlap would pay: outputs are returned after the next launch (`_step_deferred`).
        self.defer_outputs = self.spec is not None and wants_overlap
        self._inflight: InFlight | None = None

    def _speculative(self, config: SchedulerConfig, proposer: Proposer | None) -> SpeculativeDecoder | None:
        """Speculative decoding's part (None: off); a draft model's proposer is built by the caller."""
        if config.speculative_algorithm is None:
            return None
        if proposer is None:
            assert config.speculative_algorithm == "ngram", "a draft-model proposer is passed in (scheduler/build.py)"
            proposer = NgramProposer(config.speculative_ngram_max, config.speculative_ngram_min)
        return SpeculativeDecoder(config, self.pages, proposer)

    def _grammar_backend(self) -> GrammarBackend:
        return GrammarBackend(self.engine.model_dir, self.vocab_size, sorted(self.eos_ids))

    # ---------------------------------------------------------------- views of the parts
    @property
    def allocator(self) -> PageAllocator:
        return self.pages.allocator

    @property
    def cache(self) -> BasePrefixCache:
        return self.pages.cache

    @property
    def free_rows(self) -> list[int]:
        return self.pages.free_rows

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    @property
    def waiting(self) -> deque[Req]:
        return self.planner.waiting

    @property
    def prefill_budget(self) -> int:
        return self.planner.budget

    # ---------------------------------------------------------------- public API
    def add_request(
        self, rid: int, prompt_ids: list[int], sampling: SamplingParams, pooling: PoolingParams | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a request: text generation, or an embedding (`pooling`: prefill only, one vector).

        Its entry validated it: `RequestTokenizer` (tokenizer/request.py, the one path of the
        server, the shell and the offline `LLM`) has checked the prompt against the context,
        every token id against the vocabulary, and the worst case against the KV pool, and fitted
        max_tokens; `SamplingParams` has checked its own values. What stays here is what only the
        scheduler knows: whether the model serves the request's task (`_check_task`), whether
        `rid` is in use (its bookkeeping key), and whether a grammar compiles, which needs the
        engine's vocabulary and tokenizer tables (the backend is built on the first constrained
        request), and whether the LoRA adapter `lora` is loaded (UnknownAdapterError, a 404).
        Each raises ValueError, queueing nothing."""
        self._check_task(pooling)
        if rid in self.reqs:
            raise ValueError(f"request id {rid} is already in use")
        if lora is not None and (self.lora is None or lora not in self.lora.names):
            raise UnknownAdapterError(f"The model '{lora}' does not exist.")
        self.controls.add(rid, sampling)  # raises for a grammar that does not compile
        lora_id = self.lora.ref(lora) if lora is not None and self.lora is not None else None
        req = Req(rid, list(prompt_ids), sampling, eos_ids=self.eos_ids, max_total_len=self.context_len,
                  pooling=pooling, lora_id=lora_id, long_rope=self._long_rope(len(prompt_ids)))  # fmt: skip
        self.reqs[rid] = req
        self.planner.add(req)

    def _long_rope(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` rotates every position with LongRoPE's long factors:
        past the original context, as Hugging Face's Phi-3 computes it (`Req.long_rope`)."""
        return self.long_rope_from is not None and tokens > self.long_rope_from

    def _check_task(self, pooling: PoolingParams | None) -> None:
        """An embedding request needs an embedding model, a generation request a generative one."""
        if pooling is None and self.pooler is not None:
            raise TaskError("this server runs an embedding model: it serves /v1/embeddings only, not text "
                            "generation", None)  # fmt: skip
        if pooling is not None and self.pooler is None:
            raise TaskError("this server runs a text-generation model: /v1/embeddings needs an embedding model "
                            "(sentence-transformers pooling or a *Model checkpoint) or --task embed", None)  # fmt: skip
        if pooling is not None and self.pooler is not None:
            try:
                self.pooler.check_dimensions(pooling.dimensions)
            except ValueError as exc:
                raise TaskError(str(exc), "dimensions") from None

    def abort(self, rid: int) -> bool:
        req = self.reqs.pop(rid, None)
        if req is None:
            return False
        req.finish_reason = "abort"
        self.controls.forget(req)
        self._leave(req)
        return True

    def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter at run time (ValueError: LoRA off, name taken, bad adapter)."""
        self._adapters().load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Unload one: refused to new requests now, its weights kept until its requests end."""
        self._adapters().unload(name)

    def _adapters(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora or --lora-modules")
        return self.lora

    def has_work(self) -> bool:
        return bool(self.planner.waiting or self.decode.running or self._inflight)

    def stats(self) -> SchedulerStats:
        allocator, cache = self.pages.allocator, self.pages.cache
        return SchedulerStats(
            total_pages=allocator.num_pages,
            free_pages=allocator.num_free,
            cached_pages=cache.cached_pages,
            evictable_pages=cache.evictable_pages,
            running=len(self.decode.running),
            waiting=len(self.planner.waiting),
        )

    def spec_counts(self) -> dict[str, int]:
        """Speculative decoding's counters since start, as `StatsMsg` names them (zeros when off)."""
        stats = self.spec.stats if self.spec is not None else SpecStats()
        return {"spec_verify_steps": stats.verify_steps, "spec_draft_tokens": stats.draft_tokens,
                "spec_accepted_tokens": stats.accepted_tokens}  # fmt: skip

    def flush_cache(self) -> None:
        """Drop every cached prefix (only when idle): the pool returns to full."""
        assert not self.decode.running, "flush_cache while requests hold cached pages"
        self.pages.flush()

    def check_idle_invariants(self) -> None:
        assert not self.decode.running
        self.pages.check_idle()
        if self.spec is not None:
            self.spec.check_idle()

    # ---------------------------------------------------------------- one step
    def step(self) -> list[TokenOut]:
        """Plan and launch one step; return the outputs of the step that completed.

        Without overlap that is this step. With overlap (CUDA), the step launched last time
        completes while this one runs, so the host plans step N+1 while the GPU computes step N;
        inputs not yet known on the host are read on the device (`StepPlan.from_prev`)."""
        if self.defer_outputs:
            return self._step_deferred()
        plan = self._plan()
        launched: InFlight | None = None
        if plan is not None:
            launched = self._launch(plan, self._inflight.step if self._inflight else None)
        outputs: list[TokenOut] = []
        if self.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                outputs = self._complete(previous)
        elif launched is not None:
            outputs = self._complete(launched)
        if not self.decode.running and self._inflight is None:
            self.check_idle_invariants()
        return outputs

    def _step_deferred(self) -> list[TokenOut]:
        """A step with speculation on a device that runs asynchronously: the step launched by the
        last call completes first (the next proposals continue its committed tokens), the next
        step is planned and launched, and then the completed step's outputs are returned, so the
        caller's work on them (detokenizing, sending) runs while the device computes. Each plan
        sees every token of the steps before it, as without overlap."""
        previous, self._inflight = self._inflight, None
        outputs = self._complete(previous) if previous is not None else []
        plan = self._plan()
        if plan is not None:
            self._inflight = self._launch(plan, None)
        if not self.decode.running and self._inflight is None:
            self.check_idle_invariants()
        return outputs

    def _launch(self, plan: StepPlan, prev: LaunchedStepLike | None) -> InFlight:
        step = self.engine.launch(plan, prev)
        pooled = step.pooled.reqs if step.pooled is not None else []
        marks = self._advance(plan, step.sampled_reqs, pooled)
        return InFlight(step, marks, self.controls.wants_logprobs, plan.drafts)

    def _plan(self) -> StepPlan | None:
        while True:
            plan, starved = self._try_plan()
            if plan is not None or not starved:
                return plan
            # Running requests need pages and none could get any: give one back and try again.
            self._retract(self.decode.victim())

    def _try_plan(self) -> tuple[StepPlan | None, bool]:
        if self.long_rope_from is not None:
            self._cross_long_rope()
        # 1. Decodes: one token each; retract the newest requests if their pages run out.
        chosen = self.decode.plan(self.controls.grammars, self._retract)
        # 2. Prefill chunks of resident requests, then 3. admission, within the token budget.
        starved = self.planner.plan(chosen, self._retract)
        if not chosen:
            return None, starved and bool(self.decode.running)
        # 4. Speculation: proposals for decoding requests, with the pages left.
        drafts = self.spec.propose(chosen, self.controls.grammars) if self.spec is not None else {}
        return self._build_plan(chosen, drafts), False

    def _build_plan(self, reqs: list[Req], drafts: dict[int, list[int]] | None = None) -> StepPlan:
        ps = self.page_size
        out_loc: list[int] = []
        rows, pos, slots = self.pages.take_table()
        pending = {id(req): j for j, (req, _) in enumerate(self._inflight.marks)} if self._inflight else {}
        from_prev: list[tuple[int, int]] = []
        for req in reqs:
            pages = req.pages
            begin = req.cached_len
            end = begin + req.extend_len
            if req.num_pending and end == len(req.prompt_ids) + len(req.output_ids):
                # Its newest input token is still being sampled by the step in flight.
                from_prev.append((len(out_loc) + req.extend_len - 1, pending[id(req)]))
            if drafts and req.rid in drafts:  # a verify row: slots for the proposals too
                out_loc.extend(slots_of(pages, ps, begin, end + len(drafts[req.rid])))
            elif end - begin == 1:
                out_loc.append(pages[begin // ps] * ps + begin % ps)
            else:
                out_loc.extend(slots_of(pages, ps, begin, end))
        controls = self.controls
        return StepPlan(reqs, out_loc, rows, pos, slots, from_prev, controls.grammars, controls.take_released(),
                        controls.any_controls, drafts or {})  # fmt: skip

    def _advance(self, plan: StepPlan, sampled: list[Req], pooled: list[Req]) -> list[tuple[Req, int]]:
        """Account for a launched step before its tokens are known: KV is computed, and each
        sampling request holds a placeholder output token until `_complete`; an embedding request
        whose prompt is computed waits (pending, planned no more) for its vector there."""
        prefilled = [req for req in plan.reqs if req.extend_len > 1]
        window = self.kv_window
        for req in plan.reqs:
            if window is not None:  # KV behind the window of this step's first query: read by no step from here
                self.pages.slide(req, window)
            req.cached_len += req.extend_len
            req.extend_len = 0
        for req in pooled:
            req.num_pending += 1
        if plan.drafts:
            sampled = list(dict.fromkeys(sampled))  # a verify row samples at each position: one placeholder
        marks = []
        for req in sampled:
            req.output_ids.append(0)  # placeholder, filled in by _complete
            req.num_pending += 1
            marks.append((req, req.output_len - 1))
        cache_prefix = self.pages.cache_prefix
        for req in prefilled:
            # Share a prefill (chunk) at once: concurrent requests with the same prefix (a system
            # prompt, n > 1 samples) then match it instead of computing it again.
            cache_prefix(req)
        return marks

    def _complete(self, inflight: InFlight) -> list[TokenOut]:
        step = inflight.step
        tokens = step.result()
        controls = self.controls
        token_logprobs: list[LogprobEntry | None] | None = None
        if inflight.logprobs:
            controls.collect_prompt_logprobs(step)
            token_logprobs = step.token_logprobs()
        grammars = controls.grammars
        drafts = inflight.drafts
        outputs: list[TokenOut] = []
        row = 0  # the request's first token row (a verify row has one per position)
        for req, index in inflight.marks:
            j = row
            proposal = drafts.get(req.rid) if drafts else None
            row += 1 if proposal is None else 1 + len(proposal)
            req.num_pending -= 1
            if req.finished:
                continue  # aborted, or ended by an earlier token while this step was in flight
            assert self.spec is not None or proposal is None
            new = [tokens[j]] if proposal is None else self.spec.accept(proposal, tokens[j:row])  # type: ignore[union-attr]
            reason = None
            for count, token in enumerate(new):
                if count:
                    req.output_ids.append(token)  # accepted proposals after the first
                else:
                    req.output_ids[index] = token
                reason = req.finish_reason_at(index + count)
                if grammars and req.rid in grammars:
                    reason = controls.accept(req, grammars[req.rid], token, reason)
                if reason is not None:
                    del new[count + 1 :]  # every committed token is checked for the end
                    break
            last = index + len(new) - 1
            if reason is not None:
                del req.output_ids[last + 1 :]  # tokens sampled after the end are dropped
                req.finish_reason = reason
                self.reqs.pop(req.rid, None)
                self._leave(req)  # (waiting: retracted while its last token was in flight)
            elif proposal is not None:
                self.spec.roll_back(req)  # type: ignore[union-attr]
            out = TokenOut(req.rid, new, reason, req.prompt_len, req.prefix_len, last + 1)
            if token_logprobs is not None:
                entry = token_logprobs[j]
                out.logprobs = None if entry is None else [entry]
                if index == 0 and req.sampling.prompt_logprobs is not None:
                    out.prompt_logprobs = controls.take_prompt_logprobs(req.rid)
            if reason is not None:
                controls.forget(req)
            outputs.append(out)
        if step.pooled is not None:
            outputs += self._finish_pooled(step.pooled.reqs, step.pooled.embeddings())
        return outputs

    def _finish_pooled(self, reqs: list[Req], embeddings: list[bytes]) -> list[TokenOut]:
        """Embedding requests end with their vector: pages to the prefix cache, row freed."""
        outputs: list[TokenOut] = []
        for req, embedding in zip(reqs, embeddings):
            req.num_pending -= 1
            if req.finished:
                continue  # aborted while its step was in flight
            req.finish_reason = "stop"
            self.reqs.pop(req.rid, None)
            self._leave(req)
            self.controls.forget(req)
            outputs.append(TokenOut(req.rid, [], "stop", req.prompt_len, req.prefix_len, 0, embedding=embedding))
        return outputs

    # ---------------------------------------------------------------- leaving, retraction
    def _leave(self, req: Req) -> None:
        """Take a request that ended out of the running set (its pages and row go) or the queue."""
        if req.lora_id is not None and self.lora is not None:
            if req.row is not None:
                self.lora.release(req.lora_id)
            self.lora.unref(req.lora_id)
        if req.row is not None:
            self.decode.remove(req)
            self.pages.release(req)
        else:
            self.planner.remove(req)
        if self.spec is not None:
            self.spec.forget(req)

    def _retract(self, req: Req) -> None:
        """Preempt a resident request: keep its tokens, drop its KV (cached for a cheap resume)."""
        self.num_retractions += 1
        logger.debug("retracting request %s at %d tokens", req.rid, req.total_len)
        self._requeue(req)

    def _requeue(self, req: Req) -> None:
        """Drop a resident request's KV (cached, unless `long_rope`) and queue it to compute its
        tokens again, first in line; recomputed past LongRoPE's original context, they rotate
        with the long factors. Its adapter's slot is unpinned until it is admitted again."""
        if req.lora_id is not None and self.lora is not None:
            self.lora.release(req.lora_id)
        self.decode.remove(req)
        self.pages.release(req)
        if self.spec is not None:
            self.spec.forget(req)  # a draft model's KV of it goes too
        req.cached_len = 0
        req.extend_len = 0
        req.long_rope = self._long_rope(req.total_len)
        self.planner.requeue(req)

    def _cross_long_rope(self) -> None:
        """A sequence that grows past LongRoPE's original context is computed again, every
        position with the long factors, as Hugging Face's Phi-3 does in `generate` (it drops
        the cache once the input passes `original_max_position_embeddings`): its short-factor
        KV (positions below that length) goes to the prefix cache for other short prompts."""
        for req in [r for r in self.decode.running if not r.long_rope and self._long_rope(r.total_len)]:
            logger.debug("request %s passed the original context: recomputing with long rope", req.rid)
            self._requeue(req)
