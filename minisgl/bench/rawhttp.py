"""A minimal asyncio HTTP/1.1 client for the stress test: one connection per request
(`Connection: close`), event streams read event by event, and a `Cut` that closes the socket at
an exact point (mid-upload, before the response, after k events), with FIN or RST.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class HttpReply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""  # a plain (non event-stream) body
    events: list[str] = field(default_factory=list)  # `data:` payloads of an event stream
    cut: bool = False  # we closed the connection on purpose


class HttpError(Exception):
    """The server answered with something that is not HTTP, or closed mid-response."""


@dataclass(frozen=True)
class Cut:
    """Where to close the connection: `upload` (half the body sent), `response` (request sent,
    nothing read) or after `events` events of the stream. `reset` sends RST instead of FIN."""

    at: Literal["upload", "response", "events"]
    events: int = 0
    reset: bool = False


def _request_bytes(host: str, method: str, path: str, body: bytes | None, content_type: str) -> tuple[bytes, bytes]:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nAccept: */*\r\n"
    if body is not None:
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode(), body or b""


async def http_call(host: str, port: int, method: str, path: str, body: bytes | None = None, *,
                    cut: Cut | None = None, content_type: str = "application/json") -> HttpReply:  # fmt: skip
    """One request; reads the whole response (an event stream event by event) unless `cut`."""
    reader, writer = await asyncio.open_connection(host, port)
    reply = HttpReply()

    def close() -> None:
        if cut is not None and cut.reset:
            writer.transport.abort()
        else:
            writer.close()

    try:
        head, payload = _request_bytes(host, method, path, body, content_type)
        if cut is not None and cut.at == "upload":
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            reply.cut = True
            return reply
        writer.write(head + payload)
        await writer.drain()
        if cut is not None and cut.at == "response":
            reply.cut = True
            return reply
        await _read_head(reader, reply)
        streaming = reply.headers.get("content-type", "").startswith("text/event-stream")
        if not streaming:
            reply.body = await _read_body(reader, reply.headers)
            return reply
        limit = cut.events if cut is not None and cut.at == "events" else None
        await _read_events(reader, reply, limit)
        return reply
    finally:
        close()


async def _read_head(reader: asyncio.StreamReader, reply: HttpReply) -> None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise HttpError(f"no complete response head: {exc!r}") from None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HttpError(f"bad status line {lines[0]!r}")
    reply.status = int(parts[1])
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            reply.headers[name.strip().lower()] = value.strip()


async def _chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives (de-chunked)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    out = b""
    try:
        async for data in _chunks(reader, headers):
            out += data
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise HttpError(f"response body cut short: {exc!r}") from None
    return out


async def _read_events(reader: asyncio.StreamReader, reply: HttpReply, limit: int | None) -> None:
    pending = b""
    try:
        async for data in _chunks(reader, reply.headers):
            pending += data
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                for line in event.decode().split("\n"):
                    if line.startswith("data:"):
                        reply.events.append(line[5:].strip())
                if limit is not None and len(reply.events) >= limit:
                    reply.cut = True
                    return
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise HttpError(f"event stream cut short after {len(reply.events)} events: {exc!r}") from None
