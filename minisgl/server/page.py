"""`GET /`: the chat page, static HTML, JavaScript and CSS from `minisgl/server/static/`.

No build step and nothing from the network: the page talks to this server's own
`/v1/models` and `/v1/chat/completions` (streaming, read with fetch and parsed as SSE), so it
works offline. The page and its files are open without the API key (access.py lists
`PAGE_PATHS` beside `/health`): they hold nothing secret, and the key is typed into the page,
which then sends it as `Authorization: Bearer <key>` on every /v1 call.

A strict Content-Security-Policy keeps the page to its own scripts and to this origin, a
second fence behind the markdown renderer's escaping (static/markdown.js).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

STATIC_DIR = Path(__file__).resolve().parent / "static"
# URL path -> (file in STATIC_DIR, media type)
_FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(_FILES)
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_page_routes(app: FastAPI) -> None:
    for path, (name, media_type) in _FILES.items():
        app.add_api_route(path, _serve(STATIC_DIR / name, media_type), methods=["GET", "HEAD"], include_in_schema=False)


def _serve(file: Path, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        return FileResponse(file, media_type=media_type, headers=_HEADERS)

    return serve
