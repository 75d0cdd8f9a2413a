"""The HTTP front end: OpenAI-compatible routes, a native /generate, health and stats.

Handlers validate the body (protocol.py), open an inbox for their rids, send `TokenizeMsg`s and
then either collect the full answer or stream SSE chunks. A client that goes away, streaming or
not, gets its rids aborted (the scheduler frees their pages).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from minisgl.message.frontend import ErrorMsg, TextDelta
from minisgl.message.tokenizer import ChatPrompt, Prompt, TextPrompt, TokenizeMsg, TokenPrompt
from minisgl.server.frontend import FrontendAddrs, FrontendManager, Inbox, Reply
from minisgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestError,
    parse_request,
)
from minisgl.server.responses import DONE, ResponseBuilder, error_response, sse
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class AppState:
    addrs: FrontendAddrs
    served_model: str
    context_len: int
    health: Callable[[], tuple[bool, dict[str, Any]]]  # (all children alive, details)
    started: int = 0
    frontend: FrontendManager | None = None

    @property
    def fm(self) -> FrontendManager:
        assert self.frontend is not None, "the frontend starts with the app"
        return self.frontend


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

    def __init__(self, state: AppState, request: Request, inbox: Inbox) -> None:
        self.fm = state.fm
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

    def end_watch(self) -> None:
        self.watch.cancel()

    def close(self) -> None:
        self.watch.cancel()
        self.fm.release(self.inbox)


def _first_error(replies: list[Reply]) -> ErrorMsg | None:
    return next((r for r in replies if isinstance(r, ErrorMsg)), None)


def _error_from(msg: ErrorMsg) -> JSONResponse:
    return error_response(msg.status, msg.message, msg.param)


async def _respond(
    session: Session, builder: ResponseBuilder, stream: bool, include_usage: bool
) -> Response:
    try:
        if not stream:
            replies = await session.collect()
        else:
            replies = await session.first()
    except ClientGone:
        session.close()
        return Response(status_code=499)
    err = _first_error(replies)
    if err is not None:
        session.close()
        return _error_from(err)
    if not stream:
        session.close()
        for r in replies:
            builder.add(r)  # type: ignore[arg-type]
        return JSONResponse(builder.full())
    session.end_watch()  # from here on the streaming response watches the connection

    async def chunks() -> AsyncIterator[bytes]:
        head: list[bytes] = [builder.role_chunk()] if builder.kind == "chat" else []
        yield b"".join(head + _chunks(builder, replies))
        async for items in session.fm.replies(session.inbox):
            failed = _first_error(items)
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
            builder.add(r)
            chunk = builder.delta_chunk(r)
            if chunk is not None:
                out.append(chunk)
    return out


def _seeded(sampling: Any, i: int) -> Any:
    # n > 1 with a seed: give each choice its own (reproducible) stream.
    return sampling if sampling.seed is None or i == 0 else replace(sampling, seed=sampling.seed + i)


def create_app(state: AppState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.frontend = FrontendManager(state.addrs)
        state.frontend.start()
        yield
        await state.frontend.close()

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"Invalid request: {exc.errors()[0].get('msg', exc)}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(404, f"Unknown route: {request.method} {request.url.path}")
        if exc.status_code == 405:
            return error_response(405, f"Method {request.method} is not allowed on {request.url.path}")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        sampling, explicit = req.sampling(state.context_len)
        inbox = state.fm.open(req.n, notify_each=req.stream)
        prompt = ChatPrompt(req.messages)
        msgs = [TokenizeMsg(rid, prompt, _seeded(sampling, i), explicit, req.stop_list())
                for i, rid in enumerate(inbox.rids)]  # fmt: skip
        session = Session(state, request, inbox)
        await session.submit(msgs)
        builder = ResponseBuilder("chat", req.model or state.served_model, inbox.rids, shared_prompt=True)
        return await _respond(session, builder, req.stream, req.include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        sampling, explicit = req.sampling(COMPLETIONS_DEFAULT_MAX_TOKENS)
        explicit = True  # the default of 16 is a real limit, not "the rest of the context"
        prompts: list[Prompt] = [TextPrompt(p) if isinstance(p, str) else TokenPrompt(p) for p in req.prompts()]
        inbox = state.fm.open(len(prompts) * req.n, notify_each=req.stream)
        msgs = [TokenizeMsg(rid, prompts[i // req.n], _seeded(sampling, i % req.n), explicit, req.stop_list())
                for i, rid in enumerate(inbox.rids)]  # fmt: skip
        session = Session(state, request, inbox)
        await session.submit(msgs)
        builder = ResponseBuilder("completion", req.model or state.served_model, inbox.rids,
                                  shared_prompt=len(prompts) == 1)  # fmt: skip
        return await _respond(session, builder, req.stream, req.include_usage)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req: GenerateRequest = parse_request(GenerateRequest, await request.body())
        prompt: Prompt = TextPrompt(req.text) if req.text is not None else TokenPrompt(req.input_ids or [])
        inbox = state.fm.open(1, notify_each=req.stream)
        session = Session(state, request, inbox)
        await session.submit([TokenizeMsg(inbox.rids[0], prompt, req.sampling(), True, req.stop_list())])
        return await _respond_native(session, req.stream)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != state.served_model:
            return error_response(404, f"The model '{model_id}' does not exist", "model")
        return _model_card(state)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, details = state.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", **details}, status_code=200 if ok else 503)

    @app.get("/v1/internal/stats")
    async def stats() -> Response:
        try:
            s = await state.fm.stats()
        except asyncio.TimeoutError:
            return error_response(503, "the scheduler did not answer the stats query in time")
        return JSONResponse({
            "total_pages": s.total_pages, "free_pages": s.free_pages, "cached_pages": s.cached_pages,
            "evictable_pages": s.evictable_pages, "running": s.running, "waiting": s.waiting,
            "live_requests": state.fm.live_requests,
        })  # fmt: skip

    return app


def _model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.served_model, "object": "model", "created": state.started or int(time.time()),
            "owned_by": "minisgl", "max_model_len": state.context_len}  # fmt: skip


async def _respond_native(session: Session, stream: bool) -> Response:
    rid = session.inbox.rids[0]
    meta: dict[str, Any] = {"id": str(rid), "finish_reason": None}

    def fill(delta: TextDelta) -> None:
        if delta.finish_reason is not None:
            meta.update(finish_reason=delta.finish_reason, prompt_tokens=delta.prompt_tokens,
                        completion_tokens=delta.completion_tokens, cached_tokens=delta.cached_tokens)  # fmt: skip

    try:
        replies = await (session.first() if stream else session.collect())
    except ClientGone:
        session.close()
        return Response(status_code=499)
    err = _first_error(replies)
    if err is not None or not stream:
        session.close()
        if err is not None:
            return _error_from(err)
        deltas = [r for r in replies if isinstance(r, TextDelta)]
        for d in deltas:
            fill(d)
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        return JSONResponse({"text": text, "output_ids": ids, "meta_info": meta})
    session.end_watch()

    def chunk(d: TextDelta) -> bytes:
        fill(d)
        return sse({"text": d.text, "output_ids": d.token_ids, "meta_info": dict(meta)})

    async def chunks() -> AsyncIterator[bytes]:
        yield b"".join(chunk(d) for d in replies if isinstance(d, TextDelta))
        async for items in session.fm.replies(session.inbox):
            yield b"".join(chunk(d) for d in items if isinstance(d, TextDelta))
        yield DONE

    return _CleanupStreamingResponse(chunks(), on_close=session.close)
