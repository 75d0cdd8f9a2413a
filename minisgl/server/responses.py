"""OpenAI response objects and SSE framing, built from text deltas.

Kept apart from the routes so the exact object shapes are in one place.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import JSONResponse

from minisgl.message.frontend import TextDelta

Kind = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
            503: "service_unavailable"}.get(status, "server_error")  # fmt: skip
    code = {404: "not_found", 405: "method_not_allowed", 503: "service_unavailable"}.get(status)
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class ChoiceState:
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: TextDelta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.prompt_tokens = delta.prompt_tokens
            self.cached_tokens = delta.cached_tokens
            self.completion_tokens = delta.completion_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class ResponseBuilder:
    """The objects of one client request (chat or text completion) with `n` choices.

    `shared_prompt`: every choice has the same prompt (chat, n > 1), so usage counts it once."""

    def __init__(self, kind: Kind, model: str, rids: list[int], shared_prompt: bool) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.choices = [ChoiceState() for _ in rids]
        self.shared_prompt = shared_prompt
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def add(self, delta: TextDelta) -> ChoiceState:
        choice = self.choices[self.index[delta.rid]]
        choice.add(delta)
        return choice

    def usage(self) -> dict[str, Any]:
        if self.shared_prompt:
            prompt = max(c.prompt_tokens for c in self.choices)
            cached = max(c.cached_tokens for c in self.choices)
        else:
            prompt = sum(c.prompt_tokens for c in self.choices)
            cached = sum(c.cached_tokens for c in self.choices)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ------------------------------------------------------------------ non-streaming
    def full(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for i, c in enumerate(self.choices):
            if self.kind == "chat":
                message = {"role": "assistant", "content": c.text}
                choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason})
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
        """Chat streams open with the assistant role, once per choice."""
        return self._chunk(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(len(self.choices))]
        )  # fmt: skip

    def delta_chunk(self, delta: TextDelta) -> bytes | None:
        """The chunk for one delta; the finishing delta carries its finish_reason."""
        i = self.index[delta.rid]
        if not delta.text and delta.finish_reason is None:
            return None
        if self.kind == "chat":
            body: dict[str, Any] = {"content": delta.text} if delta.text else {}
            choice = {"index": i, "delta": body, "logprobs": None, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": i, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        return self._chunk([choice])

    def usage_chunk(self) -> bytes:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                    "model": self.model, "choices": [], "usage": self.usage()})  # fmt: skip
