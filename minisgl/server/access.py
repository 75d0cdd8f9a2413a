"""Who may call the server: an optional API key and CORS origins.

With a key (`--api-key`, or the environment's: minisgl/env.py) every route needs
`Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send it), except
`GET /health` and `GET /metrics` (load balancers and Prometheus scrapers carry no key, as with
vLLM) and CORS preflights. A missing or wrong key is a 401 in OpenAI's error shape (Anthropic's
under /v1/messages).

Both run before admission control (admission.py, the app's innermost middleware): a request
without a valid key is a 401 even when the server is overloaded or draining, and never counts
as admitted or rejected there.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from minisgl.server.anthropic_protocol import anthropic_error
from minisgl.server.responses import error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})


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


def install_access(app: FastAPI, api_key: str | None, cors_origins: list[str]) -> None:
    # The last middleware added runs first: CORS wraps the key check, so 401s carry CORS headers;
    # admission.guard_app appends its guard after these, so it runs after both.
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in cors_origins)  # fmt: skip
