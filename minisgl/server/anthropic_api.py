"""Anthropic's Messages API: `POST /v1/messages` (plain and streamed) and its `count_tokens`.

A Messages body is translated into the chat request (anthropic_protocol.py) and runs the chat
path: the same `TokenizeMsg(ChatPrompt(...))`, the same `ChoiceState` that splits the reply
into text and tool calls (and the detokenizer's split of the thinking, with --reasoning-parser:
`thinking` blocks, whose `signature` is empty: nothing is signed here). Only the shapes differ:
content blocks, `stop_reason`, and the stream's
named SSE events (`message_start`, `content_block_start`, `ping`, `content_block_delta`,
`content_block_stop`, `message_delta`, `message_stop`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl.message.frontend import ErrorMsg, TextDelta, TokensMsg
from minisgl.message.tokenizer import ChatPrompt, TokenizeQueryMsg
from minisgl.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    anthropic_error_body,
)
from minisgl.server.choice import ChoiceOptions, ChoiceState, ChoiceUpdate
from minisgl.server.openapi import body
from minisgl.server.request_msgs import chat_msgs, chat_options, chat_prompt
from minisgl.server.frontend import Reply
from minisgl.server.protocol import RequestError, parse_request
from minisgl.server.session import Session, _CleanupStreamingResponse
from minisgl.server.state import AppState


def event(name: str, data: dict[str, Any]) -> bytes:
    body = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {body}\n\n".encode()


def stop_reason(state: ChoiceState) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if state.finish_reason == "tool_calls":
        return "tool_use", None
    if state.finish_reason == "length":
        return "max_tokens", None
    if state.finish_reason == "stop" and isinstance(state.stop_reason, str):
        return "stop_sequence", state.stop_reason
    if state.finish_reason is None:
        return None, None
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:  # cut short by max_tokens: no complete input to show
        return {}


class MessageBuilder:
    """The Anthropic message of one request (one choice), whole or as stream events."""

    def __init__(self, model: str, options: ChoiceOptions) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.state = ChoiceState(options)
        self.block: str | None = None  # the open block's type while streaming
        self.blocks = 0  # blocks opened so far
        self.pinged = False

    def _message(self, content: list[dict[str, Any]], input_tokens: int, output_tokens: int) -> dict[str, Any]:
        reason, sequence = stop_reason(self.state)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}  # fmt: skip

    def full(self, replies: list[Reply]) -> dict[str, Any]:
        for r in replies:
            if isinstance(r, TextDelta):
                self.state.add(r)
        s = self.state
        content: list[dict[str, Any]] = [{"type": "thinking", "thinking": s.reasoning, "signature": ""}] \
            if s.reasoning else []  # fmt: skip
        if s.text or not s.calls:
            content.append({"type": "text", "text": s.text})
        for call in s.calls:
            function = call["function"]
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
                            "input": _input(function["arguments"])})  # fmt: skip
        return self._message(content, s.prompt_tokens, s.completion_tokens)

    # ------------------------------------------------------------------ streaming
    def start(self, first: TextDelta | None) -> bytes:
        tokens = first.prompt_tokens if first is not None else 0
        return event("message_start", {"message": self._message([], tokens, 0)})

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.block = kind
        out.append(event("content_block_start", {"index": self.blocks, "content_block": block}))
        self.blocks += 1
        if not self.pinged:
            self.pinged = True
            out.append(event("ping", {}))
        return out

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [event("content_block_stop", {"index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def events(self, delta: TextDelta) -> list[bytes]:
        update: ChoiceUpdate = self.state.add(delta)
        out: list[bytes] = []
        if update.reasoning:
            if self.block != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": update.reasoning}))
        if update.content:
            if self.block != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": update.content}))
        for call in update.calls:
            if call.id is not None:
                block: dict[str, Any] = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}}
                out += self._open("tool_use", block)
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        if update.finish_reason is not None:
            out += self.finish()
        return out

    def finish(self) -> list[bytes]:
        out = self._close()
        if not self.pinged:
            self.pinged = True
            out.append(event("ping", {}))
        reason, sequence = stop_reason(self.state)
        out.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": {"output_tokens": self.state.completion_tokens}}))  # fmt: skip
        out.append(event("message_stop", {}))
        return out


async def _respond(session: Session, builder: MessageBuilder, stream: bool) -> Response:
    replies = await session.opening(stream, lambda err: anthropic_error(err.status, err.message))
    if isinstance(replies, Response):
        return replies
    if not stream:
        return JSONResponse(builder.full(replies))
    first = next((r for r in replies if isinstance(r, TextDelta)), None)

    async def chunks() -> AsyncIterator[bytes]:
        head = [builder.start(first)]
        yield b"".join(head + [e for r in replies if isinstance(r, TextDelta) for e in builder.events(r)])
        async for items in session.fm.replies(session.inbox):
            failed = next((r for r in items if isinstance(r, ErrorMsg)), None)
            if failed is not None:  # rejected after the stream began: end it with the error
                yield event("error", {"error": anthropic_error_body(failed.status, failed.message)["error"]})
                break
            data = [e for r in items if isinstance(r, TextDelta) for e in builder.events(r)]
            if data:
                yield b"".join(data)

    return _CleanupStreamingResponse(chunks(), on_close=session.close)


def add_anthropic_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/messages", openapi_extra=body(MessagesRequest))
    async def messages(request: Request) -> Response:
        try:
            req: MessagesRequest = parse_request(MessagesRequest, await request.body())
            if req.thinking_enabled and state.reasoning_parser is None:
                raise RequestError("extended thinking needs a server started with --reasoning-parser")
            chat = req.to_chat()
            sampling, explicit = chat.sampling(state.context_len)
        except RequestError as exc:
            return anthropic_error(exc.status, str(exc))
        inbox = state.fm.open(1, notify_each=req.stream)
        session = Session(state.fm, request, inbox)
        await session.submit(chat_msgs(chat, inbox.rids, sampling, explicit))
        return await _respond(session, MessageBuilder(req.model, chat_options(chat)), req.stream)

    @app.post("/v1/messages/count_tokens", openapi_extra=body(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        try:
            req: CountTokensRequest = parse_request(CountTokensRequest, await request.body())
            prompt = chat_prompt(req.to_chat())
        except RequestError as exc:
            return anthropic_error(exc.status, str(exc))
        query = ChatPrompt(prompt.messages, prompt.tools, {"add_generation_prompt": True})
        try:
            reply = await state.fm.query(lambda q: TokenizeQueryMsg(q, query, False), to_tokenizer=True)
        except asyncio.TimeoutError:
            return anthropic_error(503, "the tokenizer did not answer in time")
        if not isinstance(reply, TokensMsg):
            return anthropic_error(400, getattr(reply, "message", "the prompt could not be tokenized"))
        return JSONResponse({"input_tokens": len(reply.token_ids)})

    @app.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                   include_in_schema=False)  # a catch-all 404 in Anthropic's shape: not an operation
    async def unknown(request: Request, rest: str) -> Response:
        return anthropic_error(404, f"Unknown route: {request.method} {request.url.path}")
