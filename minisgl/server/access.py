"""Who may call the server and how much it reads: an optional API key, CORS origins, a body limit.

With a key (`--api-key`, or the environment's: minisgl/env.py) every route needs
`Authorization: Bearer <key>` or `x-api-key: <key>` (as Anthropic's clients send it) — `/v1/*`,
`/generate`, `/tokenize`, `/detokenize`, `/metrics`, `/v1/internal/stats`, `/openapi.json`,
`/docs`, and unknown routes, so a caller without the key learns nothing — except `GET /health`
(load balancers carry no key), the chat page's files (`GET /`, page.PAGE_PATHS: the key is typed
into the page) and CORS preflights. A missing or wrong key is a 401 in OpenAI's
error shape (Anthropic's under /v1/messages). Prometheus sends the key with
`authorization: {credentials}`.

Request bodies are read up to `max_body_bytes` (`BodyLimitMiddleware`): a larger declared
`Content-Length` is a 413 without the app seeing the body, and a chunked body is counted as it
arrives and cut off with a 413 at the limit, so no request makes the server hold more than the
limit. The rest of a refused body is read and dropped chunk by chunk (up to `DISCARD_BYTES`,
then the connection is closed) so the client can finish sending and read the 413. (Deeply nested JSON inside the limit is refused with a 400 by the JSON parser
itself: pydantic's parser stops at a fixed nesting depth, see protocol.parse_request.)

All of these run before admission control (admission.py, the app's innermost middleware): a
request without a valid key is a 401 even when the server is overloaded or draining, and never
counts as admitted or rejected there.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.server.anthropic_protocol import anthropic_error
from minisgl.server.page import PAGE_PATHS
from minisgl.server.responses import error_body, error_response

OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})  # the chat page holds no secret; its /v1 calls need the key
MAX_BODY_BYTES = 4 * 2**20  # 4 MiB: a 1M-token text prompt; 100k token ids take under 1 MiB
DISCARD_BYTES = 64 * 2**20  # of a refused body, read and dropped so the client sees the 413


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            key = headers.get(b"x-api-key")  # Anthropic's clients send the key in x-api-key
            if key is not None and hmac.compare_digest(b"Bearer " + key, self.expected):
                await self.app(scope, receive, send)
                return
            message = "Incorrect API key provided" if given or key else \
                "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            anthropic = scope["path"].startswith("/v1/messages")
            await (anthropic_error if anthropic else error_response)(401, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """A chunked body passed the limit while the app was reading it."""


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes, without reading more than `limit` of it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(scope, receive, send, body_done=False)
            return
        seen = 0
        started = body_done = False

        async def counted_receive() -> Message:
            nonlocal seen, body_done
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send, body_done)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, body_done: bool) -> None:
        # Read the rest of the body first, throwing it away (up to DISCARD_BYTES): a server that
        # answers and closes while the client is still sending makes the client's TCP see a
        # reset, and most clients then report the reset instead of the 413.
        discarded = 0
        while not body_done and discarded <= DISCARD_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            discarded += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
        body = error_body(f"The request body is larger than the server accepts ({self.limit} bytes)",
                          "invalid_request_error", None, "request_too_large")  # fmt: skip
        await JSONResponse(body, status_code=413)(scope, receive, send)


def install_access(app: FastAPI, api_key: str | None, cors_origins: list[str],
                   max_body_bytes: int = MAX_BODY_BYTES) -> None:  # fmt: skip
    # The last middleware added runs first: CORS wraps the key check, which wraps the body limit,
    # so 401s carry CORS headers and a caller without the key never has its body read;
    # admission.guard_app appends its guard after these, so it runs after all of them.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in cors_origins)  # fmt: skip
