"""Per-request controls the scheduler keeps beyond `Req`, by rid: structured-output matchers,
prompt logprobs gathered until the first output token, which requests want logprobs or use any
logit control, and the requests whose engine-side state (penalty counts) the next plan releases.

The sampling itself (masks, penalties, bias, logprobs) runs in the engine; this is the host-side
bookkeeping around it, so a step with no controlled request skips all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from minisgl.core import FinishReason, Req, SamplingParams
from minisgl.engine.step import LogprobEntry, PromptChunk
from minisgl.engine.grammar import GrammarBackend, GrammarState, grammar_key
from minisgl.engine.penalties import uses_penalties
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

# One prompt position's logprob entry; the first position has nothing to condition on: (None, []).
PromptLogprob = tuple[float | None, list[tuple[int, float]]]


class PromptLogprobSource(Protocol):
    """What `collect_prompt_logprobs` reads from a launched step."""

    def prompt_logprob_chunks(self) -> list[tuple[PromptChunk, list[LogprobEntry]]]: ...


class RequestControls:
    def __init__(self, grammar_backend: Callable[[], GrammarBackend]) -> None:
        self._make_grammar_backend = grammar_backend  # built on the first constrained request
        self._grammar_backend: GrammarBackend | None = None
        self.grammars: dict[int, GrammarState] = {}
        self._prompt_logprobs: dict[int, list[LogprobEntry]] = {}
        self._logprob_rids: set[int] = set()
        self._controlled_rids: set[int] = set()  # any logit control, grammar or logprobs
        self._released: list[int] = []

    def add(self, rid: int, sampling: SamplingParams) -> None:
        """Register a new request's controls; raises ValueError (registering nothing) for a
        grammar that does not compile."""
        grammar = self._new_grammar(sampling)
        if grammar is not None:
            self.grammars[rid] = grammar
        wants_logprobs = sampling.logprobs is not None or sampling.prompt_logprobs is not None
        if wants_logprobs:
            self._logprob_rids.add(rid)
        if (grammar is not None or wants_logprobs or uses_penalties(sampling) or sampling.logit_bias
                or sampling.min_tokens):
            self._controlled_rids.add(rid)

    def _new_grammar(self, sampling: SamplingParams) -> GrammarState | None:
        if grammar_key(sampling) is None:
            return None
        if self._grammar_backend is None:
            self._grammar_backend = self._make_grammar_backend()
        return self._grammar_backend.new_state(sampling)

    def forget(self, req: Req) -> None:
        """Drop the state of a request that left (finished or aborted)."""
        rid = req.rid
        self.grammars.pop(rid, None)
        self._prompt_logprobs.pop(rid, None)
        self._logprob_rids.discard(rid)
        self._controlled_rids.discard(rid)
        if uses_penalties(req.sampling):
            self._released.append(rid)

    @property
    def wants_logprobs(self) -> bool:
        """Some live request asked for (prompt) logprobs: a step's must be read back."""
        return bool(self._logprob_rids)

    @property
    def any_controls(self) -> bool:
        """Some live request uses a logit control or logprobs: the engine must look for them."""
        return bool(self._controlled_rids)

    def take_released(self) -> list[int]:
        """Requests whose engine-side state goes with the next plan (and cleared here)."""
        released, self._released = self._released, []
        return released

    @staticmethod
    def accept(req: Req, grammar: GrammarState, token: int, reason: FinishReason | None) -> FinishReason | None:
        """Advance the request's matcher; it ends once the grammar accepted a stop token."""
        if not grammar.accept(token):
            # Only reachable if a token was sampled without the request's current mask.
            logger.error("request %s: token %d violates its grammar; ending it", req.rid, token)
            return reason or "stop"
        if grammar.terminated:
            return reason or "stop"
        return reason

    def collect_prompt_logprobs(self, step: PromptLogprobSource) -> None:
        """Gather prompt-logprob chunks until the request's first output token is known (a
        recomputation after retraction produces them again; those are dropped)."""
        for chunk, entries in step.prompt_logprob_chunks():
            req = chunk.req
            if req.finished or req.output_len - req.num_pending > 0:
                continue
            gathered = self._prompt_logprobs.setdefault(req.rid, [])
            del gathered[chunk.first - 1 :]
            gathered.extend(entries)

    def take_prompt_logprobs(self, rid: int) -> list[PromptLogprob]:
        """Every prompt position's entry, sent once with the first output token."""
        return [(None, []), *self._prompt_logprobs.pop(rid, [])]
