"""OpenAI's Responses API: `POST /v1/responses` (plain and streamed), `GET` and `DELETE
/v1/responses/{id}`.

A Responses body is translated into the chat request (responses_protocol.py) and runs the chat
path: the same `TokenizeMsg(ChatPrompt(...))`, the same `ChoiceState` splitting the reply into
text and tool calls (and the detokenizer's split of the thinking, with --reasoning-parser). Only
the shapes differ: output items (`reasoning`, `message`, `function_call`), usage with input /
output tokens, and the stream's named events (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`, their `.done`s,
`response.completed` or `response.incomplete`), each with its `sequence_number`.

Responses with `store` (the default) are kept in a bounded in-memory LRU (--max-stored-responses)
for `previous_response_id` and GET; `store: false` keeps nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl.message.frontend import ErrorMsg, TextDelta
from minisgl.server.choice import ChoiceOptions, ChoiceState, ChoiceUpdate
from minisgl.server.frontend import Reply
from minisgl.server.openapi import body
from minisgl.server.protocol import RequestError, parse_request
from minisgl.server.request_msgs import chat_msgs, chat_options
from minisgl.server.responses import error_response
from minisgl.server.responses_protocol import ResponsesRequest, ResponseStore, StoredResponse, input_messages
from minisgl.server.session import Session, _CleanupStreamingResponse, error_from
from minisgl.server.state import AppState


def _event(name: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseObjectBuilder:
    """The response of one request (one choice): its output items grow as deltas arrive, and each
    change is also a stream event (non-streaming requests drop the events)."""

    def __init__(self, req: ResponsesRequest, model: str, options: ChoiceOptions) -> None:
        self.req = req
        self.model = model
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.state = ChoiceState(options)
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still growing
        self.sequence = 0
        self.reasoning_tokens = 0

    # ------------------------------------------------------------------ the response object
    @property
    def status(self) -> str:
        if self.state.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.state.finish_reason == "length" else "completed"

    def response(self) -> dict[str, Any]:
        req, s, status = self.req, self.state, self.status
        usage = None
        if s.finish_reason is not None:
            usage = {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                     "output_tokens": s.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": s.prompt_tokens + s.completion_tokens}  # fmt: skip
        text_format = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": list(self.output), "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": text_format},
            "tool_choice": req.tool_choice or "auto", "tools": list(req.tools or []), "top_p": req.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "metadata": req.metadata or {},
            "user": req.user,
        }  # fmt: skip

    def conversation(self) -> list[dict[str, Any]]:
        """This response's input and output as chat messages (for a later previous_response_id)."""
        s = self.state
        reply: dict[str, Any] = {"role": "assistant", "content": s.text or None}
        if s.calls:
            reply["tool_calls"] = [dict(call) for call in s.calls]
        elif not s.text:
            reply["content"] = ""
        return input_messages(self.req.input) + [reply]

    # ------------------------------------------------------------------ items and events
    def _emit(self, name: str, data: dict[str, Any]) -> bytes:
        out = _event(name, {**data, "sequence_number": self.sequence})
        self.sequence += 1
        return out

    def start(self) -> list[bytes]:
        snapshot = self.response()
        return [self._emit("response.created", {"response": snapshot}),
                self._emit("response.in_progress", {"response": snapshot})]  # fmt: skip

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.output.append(item)
        self.open = item
        where = {"output_index": len(self.output) - 1}
        out.append(self._emit("response.output_item.added", {**where, "item": _snapshot(item)}))
        if item["type"] in ("reasoning", "message"):
            part = {"type": "reasoning_text", "text": ""} if item["type"] == "reasoning" else _text_part("")
            out.append(self._emit("response.content_part.added",
                                  {**where, "item_id": item["id"], "content_index": 0, "part": part}))  # fmt: skip
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "incomplete" if self.state.finish_reason == "length" else "completed"
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        out: list[bytes] = []
        if item["type"] == "function_call":
            out.append(self._emit("response.function_call_arguments.done",
                                  {**where, "name": item["name"], "arguments": item["arguments"]}))  # fmt: skip
        else:
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(self._emit(kind, {**where, "content_index": 0, "text": part["text"], **extra}))
            out.append(self._emit("response.content_part.done", {**where, "content_index": 0, "part": dict(part)}))
        out.append(self._emit("response.output_item.done",
                              {"output_index": where["output_index"], "item": _snapshot(item)}))  # fmt: skip
        return out

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def add(self, delta: TextDelta) -> list[bytes]:
        update: ChoiceUpdate = self.state.add(delta)
        if delta.reasoning and not delta.text:
            self.reasoning_tokens += len(delta.token_ids)
        out: list[bytes] = []
        if update.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open({"type": "reasoning", "id": _new_id("rs_"), "summary": [], "status": "in_progress",
                                   "content": [{"type": "reasoning_text", "text": ""}]})  # fmt: skip
            self.open["content"][0]["text"] += update.reasoning  # type: ignore[index]
            out.append(self._emit("response.reasoning_text.delta",
                                  {**self._where(), "content_index": 0, "delta": update.reasoning}))  # fmt: skip
        if update.content:
            if self.open is None or self.open["type"] != "message":
                out += self._open({"type": "message", "id": _new_id("msg_"), "status": "in_progress",
                                   "role": "assistant", "content": [_text_part("")]})  # fmt: skip
            self.open["content"][0]["text"] += update.content  # type: ignore[index]
            out.append(self._emit("response.output_text.delta",
                                  {**self._where(), "content_index": 0, "delta": update.content, "logprobs": []}))  # fmt: skip
        for call in update.calls:
            if call.id is not None:
                out += self._open({"type": "function_call", "id": _new_id("fc_"), "call_id": call.id,
                                   "name": call.name, "arguments": "", "status": "in_progress"})  # fmt: skip
            if call.arguments and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += call.arguments
                out.append(self._emit("response.function_call_arguments.delta",
                                      {**self._where(), "delta": call.arguments}))  # fmt: skip
        if update.finish_reason is not None:
            out += self.finish()
        return out

    def finish(self) -> list[bytes]:
        out = self._close()
        if not self.output:  # an empty reply is still one (empty) message
            out += self._open({"type": "message", "id": _new_id("msg_"), "status": "in_progress",
                               "role": "assistant", "content": [_text_part("")]}) + self._close()  # fmt: skip
        name = "response.incomplete" if self.status == "incomplete" else "response.completed"
        out.append(self._emit(name, {"response": self.response()}))
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))  # a copy: the item keeps growing after the event went out


async def _respond(session: Session, builder: ResponseObjectBuilder, store: ResponseStore) -> Response:
    stream = builder.req.stream

    def keep() -> None:
        if builder.req.store and builder.state.finish_reason is not None:
            store.put(builder.id, StoredResponse(builder.response(), builder.conversation()))

    replies = await session.opening(stream, error_from)
    if isinstance(replies, Response):
        return replies
    if not stream:
        for r in replies:
            if isinstance(r, TextDelta):
                builder.add(r)
        keep()
        return JSONResponse(builder.response())

    def events(items: list[Reply]) -> list[bytes]:
        return [e for r in items if isinstance(r, TextDelta) for e in builder.add(r)]

    async def chunks() -> AsyncIterator[bytes]:
        yield b"".join(builder.start() + events(replies))
        async for items in session.fm.replies(session.inbox):
            failed = next((r for r in items if isinstance(r, ErrorMsg)), None)
            if failed is not None:  # rejected after the stream began: end it with the error
                yield builder._emit("error", {"code": str(failed.status), "message": failed.message,
                                              "param": failed.param})  # fmt: skip
                break
            data = events(items)
            if data:
                yield b"".join(data)
        keep()

    return _CleanupStreamingResponse(chunks(), on_close=session.close)


def add_responses_routes(app: FastAPI, state: AppState) -> None:
    store = ResponseStore(state.max_stored_responses)

    @app.post("/v1/responses", openapi_extra=body(ResponsesRequest))
    async def create(request: Request) -> Response:
        req: ResponsesRequest = parse_request(ResponsesRequest, await request.body())
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id)
            if previous is None:
                raise RequestError(f"Previous response with id '{req.previous_response_id}' not found.",
                                   "previous_response_id", status=404)  # fmt: skip
            history = previous.conversation
        chat = req.to_chat(history)
        sampling, explicit = chat.sampling(state.context_len)
        inbox = state.fm.open(1, notify_each=req.stream)
        session = Session(state.fm, request, inbox)
        await session.submit(chat_msgs(chat, inbox.rids, sampling, explicit))
        builder = ResponseObjectBuilder(req, req.model or state.served_model, chat_options(chat))
        return await _respond(session, builder, store)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        item = store.get(response_id)
        if item is None:
            return error_response(404, f"Response with id '{response_id}' not found.", "response_id")
        return JSONResponse(item.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        if not store.delete(response_id):
            return error_response(404, f"Response with id '{response_id}' not found.", "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
