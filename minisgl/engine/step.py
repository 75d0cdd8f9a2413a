"""What a step is, on both sides of the engine: the scheduler's plan and the launched step's results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from minisgl.core import Req
from minisgl.engine.grammar import GrammarState
from minisgl.engine.pooling import PooledRows
from minisgl.engine.sampler import TokenLogprobs, token_logprobs

# A token's logprob and the top alternatives [(token id, logprob), ...], most likely first.
LogprobEntry = tuple[float, list[tuple[int, float]]]


@dataclass
class StepPlan:
    """One step, as decided by the scheduler.

    Each request computes `all_ids[cached_len : cached_len + extend_len]`; `out_loc` lists the
    KV slot of every such token, request after request. `table_*` are extra token-table entries
    (a prefix matched in the cache at admission) written before the forward.
    """

    reqs: list[Req]
    out_loc: list[int]
    table_rows: list[int] = field(default_factory=list)
    table_pos: list[int] = field(default_factory=list)
    table_slots: list[int] = field(default_factory=list)
    # (token index in this step, index into the in-flight step's sampled tokens): inputs not yet
    # known on the host (overlap scheduling).
    from_prev: list[tuple[int, int]] = field(default_factory=list)
    # Structured output: the grammar state of each constrained request (by rid), current as of
    # every token it has produced (such requests never sample with a token still pending).
    grammars: dict[int, GrammarState] = field(default_factory=dict)
    # Requests that left the scheduler since the last plan: their per-request engine state goes.
    released_rids: list[int] = field(default_factory=list)
    # False when no request uses a logit control or logprobs: the engine skips looking for them.
    controls: bool = True
    # Speculative decoding: per rid of a decoding request, the tokens proposed after its last one.
    # Its row computes that token and them (`out_loc` has a slot for each) and samples at every one.
    drafts: dict[int, list[int]] = field(default_factory=dict)


class PromptChunk(NamedTuple):
    """Prompt-logprob rows of one request in a step: targets prompt_ids[first : first + num_targets]."""

    req: Req
    first: int  # prompt position of the first target token (>= 1)
    num_targets: int


def host_copy(result: TokenLogprobs) -> TokenLogprobs:
    """Start a device-to-host copy (non-blocking; valid once the step's event completes)."""
    return TokenLogprobs(*(t.to("cpu", non_blocking=True) for t in result))


def _entries(result: TokenLogprobs, top_ks: list[int]) -> list[LogprobEntry]:
    chosen = result.chosen.tolist()
    values = result.top_values.tolist()
    ids = result.top_ids.tolist()
    return [(c, list(zip(i[:k], v[:k]))) for c, v, i, k in zip(chosen, values, ids, top_ks)]


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens (device) and their host copy in flight."""

    sampled_reqs: list[Req]
    tokens: torch.Tensor  # [S] on the device
    host: torch.Tensor  # [S] pinned host copy, valid once `event` completes
    event: Any
    # Logprobs (host copies, valid once `event` completes), only where requests asked for them.
    logprob_rows: list[int] = field(default_factory=list)  # indices into sampled_reqs
    logprobs: TokenLogprobs | None = None
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = None  # rows: the chunks' targets, in order
    pooled: PooledRows | None = None  # embedding requests that completed their prompt, and their vectors

    def result(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def token_logprobs(self) -> list[LogprobEntry | None]:
        """Per sampled request: its token's logprob and top alternatives, or None if not asked."""
        out: list[LogprobEntry | None] = [None] * len(self.sampled_reqs)
        if self.logprobs is None:
            return out
        if self.event is not None:
            self.event.synchronize()
        top_ks = [self.sampled_reqs[i].sampling.logprobs or 0 for i in self.logprob_rows]
        for i, entry in zip(self.logprob_rows, _entries(self.logprobs, top_ks)):
            out[i] = entry
        return out

    def prompt_logprob_chunks(self) -> list[tuple[PromptChunk, list[LogprobEntry]]]:
        if self.prompt_logprobs is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        top_ks = [chunk.req.sampling.prompt_logprobs or 0 for chunk in self.prompt_chunks for _ in range(chunk.num_targets)]
        entries = _entries(self.prompt_logprobs, top_ks)
        out, start = [], 0
        for chunk in self.prompt_chunks:
            out.append((chunk, entries[start : start + chunk.num_targets]))
            start += chunk.num_targets
        return out


@dataclass
class ForwardOut:
    sampled_reqs: list[Req]  # requests whose input is complete and that got a new token
    next_tokens: list[int]


def chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int, rows: int = 1024) -> TokenLogprobs:
    """token_logprobs over many prompt rows, a block at a time (bounds the float32 temporaries)."""
    parts = [token_logprobs(logits[i : i + rows], targets[i : i + rows], top_k) for i in range(0, len(targets), rows)]
    return TokenLogprobs(*(torch.cat(column) for column in zip(*parts)))
