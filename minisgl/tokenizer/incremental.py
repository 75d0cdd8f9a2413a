"""Incremental detokenization: token ids in, text deltas out.

Pure logic (no sockets) so it is unit-tested directly. Three rules:
- never split a UTF-8 character: text ending in U+FFFD (an incomplete byte sequence) is held back
  until the next token completes it (or the request ends);
- never re-emit text: each request decodes only a short window of its newest tokens, and only the
  part after the already-emitted window is sent;
- stop strings are never emitted: text that could still grow into a stop string is held back, and
  on a match the request finishes with "stop" (the caller aborts it in the scheduler); with
  `include_stop` the matched string is kept. A stop token id's own text is dropped likewise.
A request with a reasoning parser (reasoning.py) has its emitted text split into thinking and
answer after the stop strings were cut; a parser that reads special tokens (harmony) has its
request decoded with them kept.
Special tokens are skipped by the decode function; added non-special tokens (e.g. `<think>`)
decode as one piece and so arrive whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minisgl.core import FinishReason
from minisgl.message.frontend import TextDelta, TokenLogprob
from minisgl.message.tokenizer import DetokFacts, TokenOut, TokenOutMsg
from minisgl.tokenizer.reasoning import BaseReasoningParser, ReasoningDelta, make_reasoning_parser
from minisgl.tokenizer.token_text import TokenText, joined_text, logprob_entries
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

# Decodes many id sequences at once; must skip special tokens and must not "clean up" spaces,
# so that decoding a window is a prefix-consistent function of its ids.
BatchDecode = Callable[[list[list[int]]], list[str]]

PROMPT_TAIL = 5  # prompt tokens kept as left context of the first decode window


class StopFilter:
    """Holds back text that could become a stop string; reports the first full match."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include  # a matched stop string stays in the output
        self.held = ""

    def feed(self, text: str, active: bool = True) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string that matched, if any). After a match, the
        text from (or after, with `include`) the stop string on is dropped. While not `active`
        (min_tokens not reached yet), nothing matches and nothing is held."""
        if not self.stops:
            return text, None
        buf = self.held + text
        if not active:
            self.held = ""
            return buf, None
        found = [(pos, stop) for stop in self.stops if (pos := buf.find(stop)) >= 0]
        if found:
            pos, stop = min(found, key=lambda item: item[0])
            self.held = ""
            return buf[: pos + len(stop) if self.include else pos], stop
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


@dataclass(slots=True)
class DecodeState:
    """Per-request window state. `ids[prefix_offset:read_offset]` is the window whose text was
    already emitted; `ids[prefix_offset:]` is decoded each step."""

    ids: list[int]
    prefix_offset: int
    read_offset: int
    stop: StopFilter
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    replica: int = 0
    echo_ids: list[int] | None = None  # the prompt, until its text went out (echo requests)
    unsent_ids: list[int] = field(default_factory=list)  # token ids not yet reported in a delta
    unsent_logprobs: list[TokenLogprob] | None = None  # their logprobs (requests that asked)
    prompt_logprobs: list[TokenLogprob] | None = None
    reasoning: BaseReasoningParser | None = None

    @property
    def keeps_special(self) -> bool:
        return self.reasoning is not None and self.reasoning.keeps_special_tokens


@dataclass(slots=True)
class DetokResult:
    deltas: list[TextDelta] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)  # rids finished by a stop string: abort them


class IncrementalDetokenizer:
    """All live requests of one detokenizer (the process's, or an offline `LLM`'s).

    A request's facts (`register`) arrive in the same ordered stream as its outputs and before
    the first of them, so an output of an unknown request is one that ended already."""

    def __init__(self, batch_decode: BatchDecode | None, token_text: TokenText | None = None,
                 special_decode: BatchDecode | None = None) -> None:  # fmt: skip
        """`batch_decode` None: a model without a tokenizer; deltas carry token ids (and
        logprobs) only, at the end of each request, with no per-step decoding. `special_decode`:
        the same decode keeping special tokens, for reasoning parsers that read them (default:
        `batch_decode`)."""
        self._decode = batch_decode
        self._special_decode = special_decode or batch_decode
        self._token_text = token_text or self._text_by_decode
        self._has_token_text = token_text is not None  # echo keeps special tokens through it
        self.states: dict[int, DecodeState] = {}
        # Finished by a stop string (rid -> replica); waiting for the scheduler's own final
        # output, then dropped.
        self.stopped: dict[int, int] = {}

    def register(self, facts: DetokFacts) -> None:
        tail = facts.prompt_tail_ids[-PROMPT_TAIL:]
        self.states[facts.rid] = DecodeState(
            ids=list(tail), prefix_offset=0, read_offset=len(tail), stop=StopFilter(facts.stop, facts.include_stop),
            stop_token_ids=frozenset(facts.stop_token_ids), min_tokens=facts.min_tokens, replica=facts.replica,
            echo_ids=list(facts.echo_ids) or None,
        )  # fmt: skip
        if facts.reasoning_parser is not None:
            self.states[facts.rid].reasoning = make_reasoning_parser(facts.reasoning_parser, facts.in_reasoning)

    def handle(self, msg: TokenOutMsg) -> DetokResult:
        """One scheduler iteration: register the new requests, then decode every output."""
        for facts in msg.new:
            self.register(facts)
        return self.process(msg.outs)

    def replica_of(self, rid: int) -> int:
        """The replica of a request this detokenizer finished by a stop string."""
        return self.stopped.get(rid, 0)

    def process(self, outs: list[TokenOut]) -> DetokResult:
        if self._decode is None:
            return self._process_ids(outs)
        result = DetokResult()
        live: list[tuple[TokenOut, DecodeState]] = []
        for out in outs:
            state = self.states.get(out.rid)
            if state is not None:
                # A stop token's own text is not part of the output (unless include_stop).
                cut = not state.stop.include and self._stop_token(state, out) is not None
                state.ids.extend(out.token_ids[:-1] if cut else out.token_ids)
                state.unsent_ids.extend(out.token_ids)
                self._add_logprobs(state, out)
                live.append((out, state))
            elif out.rid in self.stopped:
                if out.finish_reason is not None:
                    del self.stopped[out.rid]
            else:
                logger.debug("detokenizer: output of request %d, which has ended", out.rid)
        if not live:
            return result
        texts = self._decode_windows([state for _, state in live])
        for i, (out, state) in enumerate(live):
            new_text = self._advance(state, texts[2 * i], texts[2 * i + 1], out.finish_reason is not None)
            self._emit(result, out, state, new_text)
        return result

    def _process_ids(self, outs: list[TokenOut]) -> DetokResult:
        """Without a tokenizer: collect ids (and logprobs); one delta per request, at its end."""
        result = DetokResult()
        states = self.states
        for out in outs:
            state = states.get(out.rid)
            if state is None:
                continue
            state.unsent_ids += out.token_ids
            if out.logprobs is not None or out.prompt_logprobs is not None:
                self._add_logprobs(state, out)
            if out.finish_reason is not None:
                self._emit(result, out, state, "")
        return result

    def _decode_windows(self, states: list[DecodeState]) -> list[str]:
        """Per state its emitted window's text and its whole window's text: one batched call
        (two when some requests keep special tokens)."""
        assert self._decode is not None and self._special_decode is not None
        windows = [w for s in states for w in (s.ids[s.prefix_offset : s.read_offset], s.ids[s.prefix_offset :])]
        special = [i for i, s in enumerate(states) if s.keeps_special]
        if not special:
            return self._decode(windows)
        plain = [i for i, s in enumerate(states) if not s.keeps_special]
        texts = [""] * len(windows)
        for decode, group in ((self._decode, plain), (self._special_decode, special)):
            if group:
                decoded = decode([windows[j] for i in group for j in (2 * i, 2 * i + 1)])
                for k, i in enumerate(group):
                    texts[2 * i], texts[2 * i + 1] = decoded[2 * k], decoded[2 * k + 1]
        return texts

    @staticmethod
    def _advance(state: DecodeState, prefix_text: str, full_text: str, final: bool) -> str:
        if final:
            return full_text[len(prefix_text) :]
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.ids)
        # Keep the window short: everything before prefix_offset is never decoded again.
        if state.prefix_offset > 64:
            del state.ids[: state.prefix_offset]
            state.read_offset -= state.prefix_offset
            state.prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _emit(self, result: DetokResult, out: TokenOut, state: DecodeState, new_text: str) -> None:
        text, matched = state.stop.feed(new_text, active=out.output_tokens >= state.min_tokens)
        finish: FinishReason | None = out.finish_reason
        stop_reason: str | int | None = None
        if matched is not None:
            finish, stop_reason = "stop", matched
            if out.finish_reason is None:
                result.aborts.append(out.rid)
                self.stopped[out.rid] = state.replica
        elif finish is not None:
            text += state.stop.flush()
            stop_reason = self._stop_token(state, out)
        split = ReasoningDelta("", text)
        if state.reasoning is not None:
            split = state.reasoning.feed(text)
            if finish is not None:
                rest = state.reasoning.finish()
                split = ReasoningDelta(split.reasoning + rest.reasoning, split.content + rest.content)
            text = split.content
        echo = state.echo_ids is not None and (bool(out.token_ids) or finish is not None)
        if not text and not split.reasoning and finish is None and not echo:
            return  # nothing to show yet; its token ids ride along with the next delta
        delta = TextDelta(
            rid=out.rid,
            text=text,
            token_ids=state.unsent_ids,
            finish_reason=finish,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=out.output_tokens,
            stop_reason=stop_reason,
            logprobs=state.unsent_logprobs,
            reasoning=split.reasoning,
        )
        if echo and state.echo_ids is not None:
            ids = state.echo_ids
            if self._has_token_text:  # special tokens keep their text, as the peers echo them
                delta.prompt_text = joined_text(self._token_text, ids)
            else:
                delta.prompt_text = self._decode([ids])[0] if self._decode is not None else ""
            delta.prompt_logprobs = state.prompt_logprobs
            state.echo_ids = state.prompt_logprobs = None
        result.deltas.append(delta)
        state.unsent_ids = []
        state.unsent_logprobs = [] if state.unsent_logprobs is not None else None
        if finish is not None:
            del self.states[out.rid]

    @staticmethod
    def _stop_token(state: DecodeState, out: TokenOut) -> int | None:
        """The stop token id that ended the request with this output, if one did."""
        if out.finish_reason == "stop" and out.token_ids and out.token_ids[-1] in state.stop_token_ids:
            return out.token_ids[-1]
        return None

    def _add_logprobs(self, state: DecodeState, out: TokenOut) -> None:
        if out.logprobs is not None:
            entries = logprob_entries(self._token_text, out.token_ids, out.logprobs)
            state.unsent_logprobs = (state.unsent_logprobs or []) + entries
        if out.prompt_logprobs is not None and state.echo_ids is not None:
            state.prompt_logprobs = logprob_entries(self._token_text, state.echo_ids, out.prompt_logprobs)

    def _text_by_decode(self, token_id: int) -> tuple[str, bytes]:
        text = self._decode([[token_id]])[0] if self._decode is not None else ""
        return text, text.encode()
