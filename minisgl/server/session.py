"""One client request from submission to its last reply: waiting, disconnects, streaming.

A client that goes away, streaming or not, gets its rids aborted (the scheduler frees their
pages). Errors that arrive before the first chunk become HTTP statuses; after it, an error event
ends the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl.message.frontend import ErrorMsg, TextDelta
from minisgl.message.tokenizer import TokenizeMsg
from minisgl.server.frontend import FrontendManager, Inbox, Reply
from minisgl.server.responses import DONE, ResponseBuilder, error_response, sse


class ClientGone(Exception):
    """The HTTP client disconnected while we were waiting."""


class _CleanupStreamingResponse(StreamingResponse):
    """Runs `on_close` when the response ends for any reason (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (RuntimeError, asyncio.CancelledError):
                    pass


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _wait(inbox: Inbox, watch: asyncio.Task[None]) -> None:
    """Wait for the inbox's event, or raise ClientGone."""
    if inbox.event.is_set():
        return
    waiter = asyncio.ensure_future(inbox.event.wait())
    done, _ = await asyncio.wait({waiter, watch}, return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:
        waiter.cancel()
        raise ClientGone


class Session:
    """One client request from submission to its last reply."""

    def __init__(self, fm: FrontendManager, request: Request, inbox: Inbox) -> None:
        self.fm = fm
        self.request = request
        self.inbox = inbox
        self.watch = asyncio.ensure_future(_disconnected(request))

    async def submit(self, msgs: list[TokenizeMsg]) -> None:
        await self.fm.submit(msgs)

    async def collect(self) -> list[Reply]:
        """Everything until all rids finished (non-streaming)."""
        out: list[Reply] = []
        while not self.inbox.finished:
            await _wait(self.inbox, self.watch)
            out += self.inbox.take()
            if any(isinstance(r, ErrorMsg) for r in out):
                break
        return out + self.inbox.take()

    async def first(self) -> list[Reply]:
        """Replies until every rid has said something (or failed): errors surface as HTTP
        statuses before the stream starts."""
        out: list[Reply] = []
        heard: set[int] = set()
        while len(heard) < len(self.inbox.rids):
            await _wait(self.inbox, self.watch)
            items = self.inbox.take()
            out += items
            heard.update(r.rid for r in items)
            if any(isinstance(r, ErrorMsg) for r in items):
                break
        return out

    async def opening(self, stream: bool, on_error: Callable[[ErrorMsg], Response]) -> list[Reply] | Response:
        """The replies a response starts from: all of them, or the first batch when streaming. Or
        the response that ends it now: 499 for a client gone, `on_error` (the API's own error
        shape) for a refused request. The session is closed unless a stream goes on from here
        (then the streaming response watches the connection)."""
        try:
            replies = await (self.first() if stream else self.collect())
        except ClientGone:
            self.close()
            return Response(status_code=499)
        err = first_error(replies)
        if err is not None or not stream:
            self.close()
            if err is not None:
                return on_error(err)
        else:
            self.end_watch()
        return replies

    def end_watch(self) -> None:
        self.watch.cancel()

    def close(self) -> None:
        self.watch.cancel()
        self.fm.release(self.inbox)


def first_error(replies: list[Reply]) -> ErrorMsg | None:
    return next((r for r in replies if isinstance(r, ErrorMsg)), None)


def error_from(msg: ErrorMsg) -> JSONResponse:
    return error_response(msg.status, msg.message, msg.param)


async def respond(
    session: Session, builder: ResponseBuilder, stream: bool, include_usage: bool
) -> Response:
    replies = await session.opening(stream, error_from)
    if isinstance(replies, Response):
        return replies
    if not stream:
        for r in replies:
            if isinstance(r, TextDelta):
                builder.add(r)
        return JSONResponse(builder.full())

    async def chunks() -> AsyncIterator[bytes]:
        head: list[bytes] = [builder.role_chunk()] if builder.kind == "chat" else []
        yield b"".join(head + _chunks(builder, replies))
        async for items in session.fm.replies(session.inbox):
            failed = first_error(items)
            if failed is not None:  # rejected after the stream began: end it with the error
                yield sse({"error": {"message": failed.message, "type": "invalid_request_error",
                                     "param": failed.param, "code": None}})  # fmt: skip
                break
            data = _chunks(builder, items)
            if data:
                yield b"".join(data)
        if include_usage:
            yield builder.usage_chunk()
        yield DONE

    return _CleanupStreamingResponse(chunks(), on_close=session.close)


def _chunks(builder: ResponseBuilder, replies: list[Reply]) -> list[bytes]:
    out: list[bytes] = []
    for r in replies:
        if isinstance(r, TextDelta):
            chunk = builder.delta_chunk(r)
            if chunk is not None:
                out.append(chunk)
    return out


async def respond_native(session: Session, stream: bool) -> Response:
    rid = session.inbox.rids[0]
    meta: dict[str, Any] = {"id": str(rid), "finish_reason": None}

    def fill(delta: TextDelta) -> None:
        if delta.finish_reason is not None:
            meta.update(finish_reason=delta.finish_reason, prompt_tokens=delta.prompt_tokens,
                        completion_tokens=delta.completion_tokens, cached_tokens=delta.cached_tokens)  # fmt: skip

    replies = await session.opening(stream, error_from)
    if isinstance(replies, Response):
        return replies
    if not stream:
        deltas = [r for r in replies if isinstance(r, TextDelta)]
        for d in deltas:
            fill(d)
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        return JSONResponse({"text": text, "output_ids": ids, "meta_info": meta})

    def chunk(d: TextDelta) -> bytes:
        fill(d)
        return sse({"text": d.text, "output_ids": d.token_ids, "meta_info": dict(meta)})

    async def chunks() -> AsyncIterator[bytes]:
        yield b"".join(chunk(d) for d in replies if isinstance(d, TextDelta))
        async for items in session.fm.replies(session.inbox):
            yield b"".join(chunk(d) for d in items if isinstance(d, TextDelta))
        yield DONE

    return _CleanupStreamingResponse(chunks(), on_close=session.close)
