"""Admission control around the API server: bounded in-flight work, deadlines, graceful drain.

`AdmissionGuard` is plain ASGI middleware. In the API server (`guard_app`) it is the innermost
of the app's middleware, inside CORS and the API-key check (access.py): a request without a valid
key gets 401 whatever the load, and only requests that passed the check are counted, admitted or
turned away with 503 (which then carry CORS headers too). It follows every generation request
(POST /v1/chat/completions, /v1/completions, /generate) from the moment its headers arrive until
its last byte is sent:

- Overload: with `max_in_flight` set (running capacity + --max-queued-requests), a request
  beyond it gets 503 at once, with an OpenAI error body and `Retry-After`, before its body is
  even read. One HTTP request holds one slot, whatever its `n` or number of prompts.
- Deadline: a request still running after `request_timeout` seconds is ended by the guard
  itself: 504 when nothing was sent yet, otherwise an error event and `data: [DONE]` close the
  stream. The app then sees its client as gone, and the disconnect path aborts the request in
  the scheduler (its pages are freed) and forgets its reply state.
- Drain (SIGTERM / Ctrl-C, see `DrainingServer`): new requests and `/health` get 503; requests
  in flight may finish until the drain deadline; the rest are ended like a timeout, with 503.

The guard never reads bodies or looks inside the app: everything it does goes through the ASGI
`receive` / `send` of the request it guards. Its counters (`AdmissionCounts`, and the requests in
flight) are exported by `GET /metrics` (metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.server.responses import error_body
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

GUARDED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
RETRY_AFTER_S = 1
_FINAL_SEND_TIMEOUT_S = 5.0  # a client that stopped reading must not stall a timeout or a drain
# OpenAI error (type, param, code) by status
_KINDS: dict[int, tuple[str, None, str]] = {
    503: ("service_unavailable", None, "service_unavailable"),
    504: ("timeout_error", None, "timeout"),
}


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int | None = None  # None: unbounded
    request_timeout: float | None = None  # seconds; None: no deadline

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("request_timeout must be positive")


@dataclass(eq=False)
class Ticket:
    """One admitted request: what was sent so far, and whether the guard ended it."""

    send: Send
    response_started: bool = False
    streaming: bool = False  # the response is an event stream
    response_done: bool = False
    ended_by_guard: bool = False  # the client got the guard's error; the app's sends are dropped
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the app should see a disconnect
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one send at a time
    timer: asyncio.TimerHandle | None = None


@dataclass
class AdmissionCounts:
    admitted: int = 0
    rejected: int = 0  # 503: overloaded or draining
    timed_out: int = 0
    drain_aborted: int = 0


def guard_app(app: FastAPI, config: AdmissionConfig) -> GuardedApp:
    """Put admission control into the API server's app, before it starts, as its innermost
    middleware: the middleware added with `add_middleware` (CORS, the API key; the last added runs
    first) all run before it, so admission never answers a request that access control refuses.
    The app's `state.metrics` (a `ServerMetrics`, set by `create_app`), if any, exports the
    guard's counters. A client that goes away while its body is being read is routine under load
    (and how the guard ends a request): answer it quietly instead of through the internal-error
    handler."""
    app.add_exception_handler(ClientDisconnect, _client_gone)
    guard = AdmissionGuard(_unbound, config)

    def layer(inner: ASGIApp) -> AdmissionGuard:  # called once, when Starlette builds the stack
        guard.app = inner
        return guard

    app.user_middleware.append(Middleware(layer))
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.track_admission(guard)
    return GuardedApp(app, guard)


async def _unbound(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("the admission guard runs inside its app's middleware stack, not on its own")


class GuardedApp:
    """The API server's app as uvicorn serves it, and the `AdmissionGuard` inside it (to drain)."""

    def __init__(self, app: ASGIApp, guard: AdmissionGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    async def drain(self, timeout: float) -> int:
        return await self.guard.drain(timeout)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


class AdmissionGuard:
    def __init__(self, app: ASGIApp, config: AdmissionConfig) -> None:
        self.app = app
        self.config = config
        self.tickets: set[Ticket] = set()
        self.counts = AdmissionCounts()
        self.draining = False

    @property
    def in_flight(self) -> int:
        return len(self.tickets)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if self.draining and path == "/health":
            await _send_json(send, 503, {"status": "draining"})
            return
        guarded = method == "POST" and path in GUARDED_PATHS
        if self.draining and method == "POST":
            self.counts.rejected += 1
            await _send_error(send, 503, "The server is shutting down; send the request to another replica")
            return
        if not guarded:
            await self.app(scope, receive, send)
            return
        limit = self.config.max_in_flight
        if limit is not None and len(self.tickets) >= limit:
            self.counts.rejected += 1
            await _send_error(send, 503, f"The server is overloaded ({limit} requests in flight); retry later")
            return
        await self._run(scope, receive, send)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        ticket = Ticket(send)
        timeout = self.config.request_timeout
        if timeout is not None:
            ticket.timer = loop.call_later(timeout, self._on_deadline, ticket, timeout)
        self.tickets.add(ticket)
        self.counts.admitted += 1

        async def guarded_receive() -> Message:
            if ticket.gone.is_set():
                return {"type": "http.disconnect"}
            got = asyncio.ensure_future(receive())
            gone = asyncio.ensure_future(ticket.gone.wait())
            try:
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not got.done():
                    got.cancel()
            if got.done() and not got.cancelled():
                return got.result()
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            async with ticket.lock:
                if ticket.ended_by_guard:
                    return  # the client already has its answer
                kind = message["type"]
                if kind == "http.response.start":
                    ticket.response_started = True
                    headers = dict(message.get("headers", []))
                    ticket.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                elif kind == "http.response.body" and not message.get("more_body", False):
                    ticket.response_done = True
                await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        finally:
            if ticket.timer is not None:
                ticket.timer.cancel()
            self.tickets.discard(ticket)

    # ------------------------------------------------------------------ ending requests
    def _on_deadline(self, ticket: Ticket, timeout: float) -> None:
        if ticket in self.tickets and not ticket.response_done:
            self.counts.timed_out += 1
            logger.warning("a request ran past --request-timeout (%.0f s): ending it", timeout)
            self.end(ticket, 504, f"The request did not finish within the server's {timeout:g} s timeout")

    def end(self, ticket: Ticket, status: int, message: str) -> None:
        """Answer the client with an error now and make the app see a disconnect."""
        asyncio.get_running_loop().create_task(self._end(ticket, status, message))

    async def _end(self, ticket: Ticket, status: int, message: str) -> None:
        try:
            await asyncio.wait_for(self._final_send(ticket, status, message), _FINAL_SEND_TIMEOUT_S)
        except Exception as exc:  # the client is gone or stalled: nothing more to tell it
            logger.debug("could not send the final error of a request: %r", exc)
        finally:
            ticket.gone.set()

    async def _final_send(self, ticket: Ticket, status: int, message: str) -> None:
        async with ticket.lock:
            if ticket.ended_by_guard or ticket.response_done:
                return
            if not ticket.response_started:
                ticket.ended_by_guard = True
                await _send_error(ticket.send, status, message)
            elif ticket.streaming:
                ticket.ended_by_guard = True
                event = error_body(message, *_KINDS.get(status, ("server_error", None, "error")))
                data = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
                await ticket.send({"type": "http.response.body", "body": data, "more_body": False})
            # else: a plain response is being written; its body follows at once.

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, let those in flight finish for up to `timeout` seconds, then end
        the rest with 503. Returns how many had to be ended."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.tickets:
            logger.info("draining: waiting up to %.0f s for %d request(s) in flight", timeout, len(self.tickets))
        while self.tickets and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = [t for t in self.tickets if not t.response_done]
        for ticket in left:
            self.end(ticket, 503, "The server shut down before the request finished")
        self.counts.drain_aborted += len(left)
        if left:
            logger.warning("draining: ended %d request(s) still running after %.0f s", len(left), timeout)
        grace = loop.time() + _FINAL_SEND_TIMEOUT_S + 1.0
        while self.tickets and loop.time() < grace:
            await asyncio.sleep(0.05)
        return len(left)


async def _send_json(send: Send, status: int, body: dict[str, Any], retry_after: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry_after:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_error(send: Send, status: int, message: str) -> None:
    body = error_body(message, *_KINDS.get(status, ("server_error", None, "error")))
    await _send_json(send, status, body, retry_after=status == 503)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM / Ctrl-C drains through the guard before it stops serving
    (`shutdown_timeout` seconds at most for requests in flight); a second signal stops at once,
    as plain uvicorn does."""

    def __init__(self, config: uvicorn.Config, guard: GuardedApp, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.guard = guard
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self._loop is not None
        self._drain = self._loop.create_task(self._drain_then_exit(), name="drain")

    async def _drain_then_exit(self) -> None:
        logger.info("shutting down: refusing new requests, draining those in flight")
        try:
            await self.guard.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True
