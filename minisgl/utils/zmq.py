"""Typed one-way queues over ZMQ PUSH/PULL sockets, in a blocking and an asyncio flavour.

Every queue carries messages through the `Codec` it is given (the wire codec of
`minisgl.message.codec` in practice; this module knows nothing of messages). A sender may also
pass bytes it encoded itself (`put_encoded`), so a message is encoded once. The receiving side
binds, the senders connect, so several processes can feed one receiver. Addresses are `ipc://` paths in a
directory made fresh for each launch (`IpcDir`), so two services on one machine never collide;
scheduler ranks on other nodes bind `tcp://IP:*` (any free port) and publish `endpoint`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Generic, Protocol, TypeVar

import zmq
import zmq.asyncio

T = TypeVar("T")


class Codec(Protocol):
    """Messages <-> bytes (e.g. `minisgl.message.codec.WIRE`)."""

    def encode(self, obj: Any, /) -> bytes: ...

    def decode(self, data: bytes, /) -> Any: ...

_BLOCK_SLICE_MS = 200
_SYNC_CTX: zmq.Context | None = None
_ASYNC_CTX: zmq.asyncio.Context | None = None


def _sync_ctx() -> zmq.Context:
    # One context per process, created lazily so that nothing ZMQ exists before a spawn.
    global _SYNC_CTX
    if _SYNC_CTX is None:
        _SYNC_CTX = zmq.Context()
    return _SYNC_CTX


def _async_ctx() -> zmq.asyncio.Context:
    global _ASYNC_CTX
    if _ASYNC_CTX is None:
        _ASYNC_CTX = zmq.asyncio.Context()
    return _ASYNC_CTX


class IpcDir:
    """A private temp directory holding this launch's ipc endpoints; removed by `cleanup`."""

    def __init__(self) -> None:
        # Short prefix: ipc paths must fit in sun_path (~107 bytes).
        self.path = tempfile.mkdtemp(prefix="minisgl-")

    def addr(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _make(ctx: Any, kind: int, addr: str, bind: bool) -> Any:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never block process exit on undelivered messages
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    else:
        sock.setsockopt(zmq.SNDHWM, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class ZmqPushQueue(Generic[T]):
    """Blocking sender. `bind=False` (the default) connects to a receiver that binds."""

    def __init__(self, addr: str, codec: Codec, bind: bool = False) -> None:
        self.addr = addr
        self._encode = codec.encode
        self._sock = _make(_sync_ctx(), zmq.PUSH, addr, bind)

    def put(self, msg: T) -> None:
        self._sock.send(self._encode(msg), copy=False)

    def put_encoded(self, data: bytes) -> None:
        self._sock.send(data, copy=False)

    def put_raw(self, frames: list[bytes]) -> None:
        """Send already-encoded messages as one multipart message (used to relay to TP ranks)."""
        self._sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqPullQueue(Generic[T]):
    """Blocking receiver; binds by default."""

    def __init__(self, addr: str, codec: Codec, bind: bool = True) -> None:
        self.addr = addr
        self._decode = codec.decode
        self._sock = _make(_sync_ctx(), zmq.PULL, addr, bind)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    @property
    def endpoint(self) -> str:
        """The bound address, with the port filled in when `addr` asked for any (`tcp://IP:*`)."""
        raw: bytes = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        return raw.decode()

    def _wait_readable(self) -> None:
        # Block in slices: a signal (SIGTERM from the launcher) may be delivered to a helper
        # thread (torch, tokenizers), which does not interrupt a blocking recv; returning to
        # Python regularly lets the main thread run its handler.
        while not self._poller.poll(_BLOCK_SLICE_MS):
            pass

    def get(self) -> T:
        self._wait_readable()
        msg: T = self._decode(self._sock.recv(copy=True))
        return msg

    def decode(self, raw: bytes) -> T:
        """A message taken with `get_raw` / `drain_raw`."""
        msg: T = self._decode(raw)
        return msg

    def get_raw(self) -> bytes:
        self._wait_readable()
        raw: bytes = self._sock.recv(copy=True)
        return raw

    def get_raw_multipart(self) -> list[bytes]:
        self._wait_readable()
        frames: list[bytes] = self._sock.recv_multipart(copy=True)
        return frames

    def poll(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` (0: just check, -1: forever) for a message to be readable."""
        return bool(self._poller.poll(timeout_ms))

    def get_nowait(self) -> T | None:
        try:
            msg: T = self._decode(self._sock.recv(zmq.NOBLOCK, copy=True))
        except zmq.Again:
            return None
        return msg

    def drain_raw(self) -> list[bytes]:
        """Every message already queued, undecoded, without blocking."""
        out: list[bytes] = []
        while True:
            try:
                out.append(self._sock.recv(zmq.NOBLOCK, copy=True))
            except zmq.Again:
                return out

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqAsyncPushQueue(Generic[T]):
    def __init__(self, addr: str, codec: Codec, bind: bool = False) -> None:
        self.addr = addr
        self._encode = codec.encode
        self._sock = _make(_async_ctx(), zmq.PUSH, addr, bind)

    async def put(self, msg: T) -> None:
        await self._sock.send(self._encode(msg), copy=False)

    async def put_encoded(self, data: bytes) -> None:
        await self._sock.send(data, copy=False)

    def put_nowait(self, msg: T) -> None:
        """Send from sync code running on the event loop (e.g. a `finally` after cancellation).

        With an unbounded high-water mark, a PUSH send never has to wait."""
        self._sock.send(self._encode(msg), zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqAsyncPullQueue(Generic[T]):
    def __init__(self, addr: str, codec: Codec, bind: bool = True) -> None:
        self.addr = addr
        self._decode = codec.decode
        self._sock = _make(_async_ctx(), zmq.PULL, addr, bind)

    async def get(self) -> T:
        msg: T = self._decode(await self._sock.recv(copy=True))
        return msg

    def close(self) -> None:
        self._sock.close(linger=0)
