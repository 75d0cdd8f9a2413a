"""OpenAI response objects and SSE framing, built from text deltas.

Kept apart from the routes so the exact object shapes are in one place. Every choice carries
vLLM's `stop_reason` next to `finish_reason`: the stop string or stop token id that ended it
(None for EOS, length or a tool call). A chat reply's thinking (--reasoning-parser) goes in
`reasoning_content`, and in `reasoning` as vLLM names it now, in messages and deltas alike.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse

from minisgl.message.frontend import TextDelta, TokenLogprob
from minisgl.server.choice import ChoiceOptions, ChoiceState, ChoiceUpdate
from minisgl.server.logprobs import CompletionLogprobs, chat_logprobs
from minisgl.server.tools import ToolCallDelta

Kind = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
            405: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")  # fmt: skip
    code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
            503: "service_unavailable"}.get(status)  # fmt: skip
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ResponseBuilder:
    """The objects of one client request (chat or text completion) with `n` choices.

    `shared_prompt`: every choice has the same prompt (chat, n > 1), so usage counts it once;
    else each run of `n` consecutive choices shares one prompt (completions with a list of
    prompts and `n`), counted once per prompt. `echo_texts`: per choice, the prompt string to echo
    (completions with echo; None: use the detokenized prompt, for token-id prompts)."""

    def __init__(self, kind: Kind, model: str, rids: list[int], shared_prompt: bool,
                 options: ChoiceOptions | None = None, echo_texts: list[str | None] | None = None,
                 n: int = 1) -> None:  # fmt: skip
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.options = options or ChoiceOptions()
        texts = echo_texts or [None] * len(rids)
        self.choices = [ChoiceState(self.options, texts[i]) for i in range(len(rids))]
        self.offsets = [CompletionLogprobs() for _ in rids]  # completions' text_offset, per choice
        self.pending: list[list[TokenLogprob]] = [[] for _ in rids]  # logprobs of held-back text
        self.shared_prompt = shared_prompt
        self.n = max(1, n)
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def add(self, delta: TextDelta) -> ChoiceUpdate:
        return self.choices[self.index[delta.rid]].add(delta)

    def usage(self) -> dict[str, Any]:
        size = len(self.choices) if self.shared_prompt else self.n
        groups = [self.choices[i : i + size] for i in range(0, len(self.choices), size)]
        prompt = sum(max(c.prompt_tokens for c in group) for group in groups)
        cached = sum(max(c.cached_tokens for c in group) for group in groups)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(self, i: int, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        return self.offsets[i].build(entries)

    # ------------------------------------------------------------------ non-streaming
    def full(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for i, c in enumerate(self.choices):
            logprobs = self._logprobs(i, c.logprobs)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                if c.calls:
                    message = {"role": "assistant", "content": c.text or None, "tool_calls": c.calls}
                if c.reasoning:
                    message.update(reasoning_content=c.reasoning, reasoning=c.reasoning)
                choice = {"index": i, "message": message}
            else:
                choice = {"index": i, "text": c.text}
            choice.update(logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                    "model": self.model, "choices": choices})  # fmt: skip

    def role_chunk(self) -> bytes:
        """Chat streams open with the assistant role: one chunk per choice, as OpenAI sends them
        (a client reading `choices[0]` sees each choice start)."""
        return b"".join(
            self._chunk([{"index": i, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                          "finish_reason": None}])
            for i in range(len(self.choices))
        )  # fmt: skip

    def delta_chunk(self, delta: TextDelta) -> bytes | None:
        """The chunks for one delta. Chat: text (or tool calls) and their logprobs in one chunk,
        the finish_reason in a last one of its own with an empty delta, as OpenAI sends them;
        completions: the last text and the finish_reason in one chunk (vLLM's shape). Logprobs
        of text held back (stop strings, tool-call markup) ride with the next chunk."""
        i = self.index[delta.rid]
        update = self.add(delta)
        self.pending[i] += update.logprobs
        out = b""
        if self.kind == "completion" and update.finish_reason is not None:
            logprobs = self._logprobs(i, self.pending[i]) if self.pending[i] else None
            self.pending[i] = []
            choice = self._choice(i, update.content, [], logprobs, update.finish_reason, update.stop_reason)
            return self._chunk([choice])
        if update.reasoning and self.kind == "chat":
            logprobs = self._logprobs(i, self.pending[i]) if self.pending[i] else None
            self.pending[i] = []
            delta_body = {"reasoning_content": update.reasoning, "reasoning": update.reasoning}
            out += self._chunk([{"index": i, "delta": delta_body, "logprobs": logprobs, "finish_reason": None}])
        if update.content or update.calls:
            logprobs = self._logprobs(i, self.pending[i]) if self.pending[i] else None
            self.pending[i] = []
            out += self._chunk([self._choice(i, update.content, update.calls, logprobs, None, None)])
        if update.finish_reason is not None:
            logprobs = self._logprobs(i, self.pending[i]) if self.pending[i] else None
            self.pending[i] = []
            out += self._chunk([self._choice(i, "", [], logprobs, update.finish_reason, update.stop_reason)])
        return out or None

    def _choice(self, i: int, content: str, calls: list[ToolCallDelta], logprobs: dict[str, Any] | None,
                finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:  # fmt: skip
        choice: dict[str, Any] = {"index": i}
        if self.kind == "chat":
            body: dict[str, Any] = {"content": content} if content else {}
            if calls:
                body["tool_calls"] = [call.to_json() for call in calls]
            choice["delta"] = body
        else:
            choice["text"] = content
        choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return choice

    def usage_chunk(self) -> bytes:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                    "model": self.model, "choices": [], "usage": self.usage()})  # fmt: skip
