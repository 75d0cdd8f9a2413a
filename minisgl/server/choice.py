"""One choice of a response as its deltas arrive: text, tool calls, logprobs, finish.

Both response paths use it: streaming turns each update into a chunk, non-streaming reads the
totals at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from minisgl.message.frontend import TextDelta, TokenLogprob
from minisgl.server.tools import (
    AutoToolParser,
    BaseToolParser,
    NamedToolParser,
    ParsedDelta,
    RequiredToolParser,
    ToolCallDelta,
)


@dataclass(frozen=True)
class ChoiceOptions:
    """What every choice of one request does with its deltas."""

    tool_mode: str = "none"  # "none" | "auto" | "required" | "named"
    tool_names: tuple[str, ...] = ()
    forced_tool: str | None = None
    parallel_tools: bool = True
    logprobs: bool = False
    echo: bool = False  # completions: the prompt text (and logprobs) lead the choice


def make_parser(options: ChoiceOptions) -> BaseToolParser | None:
    names = list(options.tool_names)
    if options.tool_mode == "auto":
        return AutoToolParser(names, options.parallel_tools)
    if options.tool_mode == "required":
        return RequiredToolParser(names, options.parallel_tools)
    if options.tool_mode == "named":
        assert options.forced_tool is not None
        return NamedToolParser(options.forced_tool)
    return None


@dataclass
class ChoiceUpdate:
    """What one delta adds to the choice's visible output (`reasoning`: the thinking, apart)."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChoiceState:
    def __init__(self, options: ChoiceOptions, echo_text: str | None = None) -> None:
        self.options = options
        self.parser = make_parser(options)
        self.echo_text = echo_text  # the client's prompt string (else the detokenizer's text)
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[TokenLogprob] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.started = False

    def add(self, delta: TextDelta) -> ChoiceUpdate:
        update = ChoiceUpdate()
        if self.options.echo and not self.started:
            prompt = self.echo_text if self.echo_text is not None else (delta.prompt_text or "")
            update.content = prompt
            if self.options.logprobs:
                update.logprobs += delta.prompt_logprobs or []
        self.started = True
        self.token_ids.extend(delta.token_ids)
        update.reasoning = delta.reasoning  # split by the detokenizer; tool calls are read from the answer only
        if self.options.logprobs:
            update.logprobs += delta.logprobs or []
        parsed = self.parser.feed(delta.text) if self.parser is not None else ParsedDelta(delta.text)
        if delta.finish_reason is not None:
            if self.parser is not None:
                rest = self.parser.finish()
                parsed = ParsedDelta(parsed.content + rest.content, parsed.calls + rest.calls)
            reason: str = delta.finish_reason
            if reason == "stop" and self.parser is not None and self.parser.called:
                reason = "tool_calls"
            self.finish_reason = update.finish_reason = reason
            self.stop_reason = update.stop_reason = delta.stop_reason
            self.prompt_tokens = delta.prompt_tokens
            self.cached_tokens = delta.cached_tokens
            self.completion_tokens = delta.completion_tokens
        update.content += parsed.content
        update.calls = parsed.calls
        if update.finish_reason == "length" and self.options.tool_mode in ("required", "named"):
            update.content = ""  # a forced reply is JSON, never content
        self._record(update)
        if update.finish_reason == "length":
            self._drop_cut_call()
        return update

    def _drop_cut_call(self) -> None:
        """A forced call cut short by max_tokens is no call (vLLM, OpenAI): finish "length", no
        tool_calls. (A stream has sent its argument deltas already; its finish_reason says so.)"""
        if self.options.tool_mode == "named" and self.calls:
            try:
                json.loads(self.calls[0]["function"]["arguments"])
            except ValueError:
                self.calls = []
                self.content_parts = []

    def _record(self, update: ChoiceUpdate) -> None:
        if update.content:
            self.content_parts.append(update.content)
        if update.reasoning:
            self.reasoning_parts.append(update.reasoning)
        for call in update.calls:
            if call.id is not None:
                self.calls.append({"id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}})  # fmt: skip
            else:
                self.calls[call.index]["function"]["arguments"] += call.arguments
        self.logprobs.extend(update.logprobs)

    @property
    def text(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)
