"""Reply routing for the API server and the shell: one listener, one inbox per client request.

Every reply of every request arrives on one ZMQ queue. A single listener task puts each reply in
the inbox of the client request that owns its `rid` and wakes that inbox's event; each handler
waits only on its own inbox and swaps its list out, so nothing is lost or delivered twice, even
when replies arrive while the handler is busy. A client request may own several rids (`n > 1`,
a batch of prompts). With `--dp`, replies of every replica arrive on the same queue (the rids
are the API server's, unique across replicas); stats queries go to each replica's rank 0.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from minisgl.message.codec import WIRE
from minisgl.message.frontend import (
    DetokenizedMsg,
    EmbeddingMsg,
    EmbeddingOut,
    ErrorMsg,
    LoraAdapterReplyMsg,
    QueryErrorMsg,
    QueryReply,
    StatsMsg,
    TextDelta,
    TextDeltaMsg,
    TokensMsg,
)
from minisgl.message.scheduler import AbortMsg, StatsReqMsg
from minisgl.message.tokenizer import TokenizeMsg
from minisgl.utils.logging import get_logger
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue

logger = get_logger(__name__)

Reply = TextDelta | ErrorMsg | EmbeddingOut  # an EmbeddingOut (finish_reason "stop") ends its request


class ReplyObserver(Protocol):
    """Sees every request open and every reply as it arrives (the /metrics timings)."""

    def opened(self, rids: list[int]) -> None: ...

    def reply(self, reply: Reply) -> None: ...

    def forget(self, rids: list[int]) -> None: ...


_OUT_OF_RANGE = "A number in the request is out of range"


def _encoded(msgs: Sequence[object]) -> list[bytes] | None:
    """Every message encoded, or None when one does not fit on the wire: msgpack carries no
    integer beyond 64 bits, and such a value in a request is the client's error, not an internal
    one. The bytes are what is sent (one encode per message)."""
    try:
        return [WIRE.encode(msg) for msg in msgs]
    except (TypeError, ValueError, OverflowError):
        return None


@dataclass(frozen=True)
class FrontendAddrs:
    recv: str  # where the detokenizer, the tokenizer and scheduler rank 0 send replies
    tokenizer: str
    scheduler: str  # stats queries go straight to rank 0 (of replica 0)
    other_replicas: tuple[str, ...] = ()  # rank 0 of replicas 1, 2, ... (--dp)

    @property
    def schedulers(self) -> tuple[str, ...]:
        return (self.scheduler, *self.other_replicas)


@dataclass(frozen=True)
class ServiceStats:
    """Every replica's `StatsMsg`, in replica order."""

    replicas: list[StatsMsg]

    @property
    def total(self) -> StatsMsg:
        """The counts summed over replicas (query_id of the first)."""
        sums = {f.name: sum(getattr(r, f.name) for r in self.replicas) for f in fields(StatsMsg)}
        return StatsMsg(**{**sums, "query_id": self.replicas[0].query_id})


@dataclass(eq=False)
class Inbox:
    """Replies for the rids of one client request. `notify_each=False` wakes the owner only when
    a rid finishes (non-streaming handlers do not need every token).

    Memory held for a client that reads slowly or never reads its stream is bounded here: the
    ASGI `send` of its response waits while the socket's write buffer is full (uvicorn's flow
    control pauses at the transport's high-water mark, 64 KiB, beyond the kernel's socket
    buffer), so the handler stops taking replies and they pile up in `items`, at most one
    delta per generated token: the request's max_tokens (capped by the context length) times
    its number of choices. Generation itself never waits for the client. The pile goes when
    the client disconnects or --request-timeout ends the request; until then the request keeps
    its admission slot (admission.py). tests/e2e/test_hostile.py measures it."""

    rids: list[int]
    notify_each: bool = True
    items: list[Reply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    unfinished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unfinished = set(self.rids)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def push(self, reply: Reply) -> None:
        self.items.append(reply)
        done = isinstance(reply, ErrorMsg) or reply.finish_reason is not None
        if done:
            self.unfinished.discard(reply.rid)
        if done or self.notify_each:
            self.event.set()

    def take(self) -> list[Reply]:
        self.event.clear()
        items, self.items = self.items, []
        return items


class FrontendManager:
    def __init__(self, addrs: FrontendAddrs, observer: ReplyObserver | None = None) -> None:
        self.recv: ZmqAsyncPullQueue[object] = ZmqAsyncPullQueue(addrs.recv, WIRE)
        self.to_tokenizer: ZmqAsyncPushQueue[object] = ZmqAsyncPushQueue(addrs.tokenizer, WIRE)
        self.to_schedulers = [ZmqAsyncPushQueue[object](addr, WIRE) for addr in addrs.schedulers]
        self._rids = itertools.count()
        self._query_ids = itertools.count()
        self._inboxes: dict[int, Inbox] = {}
        self._queries: dict[int, asyncio.Future[QueryReply]] = {}
        self.observer = observer
        self._listener: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None  # set once a worker died: every request fails with 503

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the listener; call from inside the running event loop."""
        if self._listener is None:
            self._loop = asyncio.get_running_loop()
            self._listener = self._loop.create_task(self._listen(), name="frontend-listener")

    def fail_all_threadsafe(self, reason: str) -> None:
        """A worker died: fail every live and future request with 503 (from any thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        for inbox in {id(b): b for b in self._inboxes.values()}.values():
            for rid in sorted(inbox.unfinished):
                inbox.push(ErrorMsg(rid, reason, 503))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except asyncio.CancelledError:
                pass
        for queue in (self.recv, self.to_tokenizer, *self.to_schedulers):
            queue.close()

    @property
    def live_requests(self) -> int:
        return len(self._inboxes)

    # ------------------------------------------------------------------ requests
    def open(self, n: int, notify_each: bool = True) -> Inbox:
        rids = [next(self._rids) for _ in range(n)]
        inbox = Inbox(rids, notify_each)
        for rid in rids:
            self._inboxes[rid] = inbox
        if self.observer is not None:
            self.observer.opened(rids)
        # Backstop: however the request's task ends (a handler that raised after opening, a
        # cancelled task), its reply state goes and its unfinished rids are aborted.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._reap(inbox))
        return inbox

    def _reap(self, inbox: Inbox) -> None:
        if any(self._inboxes.get(rid) is inbox for rid in inbox.rids):
            logger.warning("request %d ended without releasing its replies: releasing them now", inbox.rids[0])
            try:
                self.release(inbox)
            except Exception as exc:  # shutting down: the queues are closed
                logger.debug("could not abort request %d: %r", inbox.rids[0], exc)

    async def submit(self, msgs: list[TokenizeMsg]) -> None:
        if self.dead is not None:
            for msg in msgs:
                self._inboxes[msg.rid].push(ErrorMsg(msg.rid, self.dead, 503))
            return
        encoded = _encoded(msgs)
        if encoded is None:
            for msg in msgs:
                self._inboxes[msg.rid].push(ErrorMsg(msg.rid, _OUT_OF_RANGE, 400))
            return
        for data in encoded:
            await self.to_tokenizer.put_encoded(data)

    async def replies(self, inbox: Inbox) -> AsyncIterator[list[Reply]]:
        """Batches of replies until every rid of the inbox has finished (or failed)."""
        while True:
            if inbox.items:
                yield inbox.take()
            elif inbox.finished:
                return
            else:
                await inbox.event.wait()  # set by every push since the last take()

    def release(self, inbox: Inbox) -> None:
        """Forget the inbox; rids that are still running are aborted."""
        pending = [rid for rid in inbox.rids if rid in inbox.unfinished]
        for rid in inbox.rids:
            self._inboxes.pop(rid, None)
        if self.observer is not None:
            self.observer.forget(inbox.rids)
        for rid in pending:
            logger.info("Aborting request %d", rid)
            inbox.unfinished.discard(rid)
            # Sync send: this also runs from `finally` blocks of cancelled tasks.
            self.to_tokenizer.put_nowait(AbortMsg(rid))

    # ------------------------------------------------------------------ queries
    async def query(self, make: Callable[[int], object], to_tokenizer: bool, timeout: float = 5.0,
                    replica: int = 0) -> QueryReply:  # fmt: skip
        """Send `make(query_id)` to the tokenizer (or rank 0 of `replica`) and await its answer."""
        query = next(self._query_ids)
        encoded = _encoded([make(query)])
        if encoded is None:
            return QueryErrorMsg(query, _OUT_OF_RANGE)
        future: asyncio.Future[QueryReply] = asyncio.get_running_loop().create_future()
        self._queries[query] = future
        try:
            await (self.to_tokenizer if to_tokenizer else self.to_schedulers[replica]).put_encoded(encoded[0])
            return await asyncio.wait_for(future, timeout)
        finally:
            self._queries.pop(query, None)

    async def stats(self, timeout: float = 5.0) -> ServiceStats:
        """Every replica's stats; TimeoutError when one does not answer within `timeout`."""
        replies = await asyncio.gather(*(
            self.query(StatsReqMsg, to_tokenizer=False, timeout=timeout, replica=i)
            for i in range(len(self.to_schedulers))
        ))  # fmt: skip
        assert all(isinstance(r, StatsMsg) for r in replies)
        return ServiceStats([r for r in replies if isinstance(r, StatsMsg)])

    # ------------------------------------------------------------------ listener
    async def _listen(self) -> None:
        while True:
            try:
                msg = await self.recv.get()
                self._dispatch(msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad message must not kill routing for everyone
                logger.exception("frontend listener: dropping a reply it could not handle")

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, TextDeltaMsg):
            for delta in msg.deltas:
                if self.observer is not None:
                    self.observer.reply(delta)
                inbox = self._inboxes.get(delta.rid)
                if inbox is not None:  # else: finished or aborted already
                    inbox.push(delta)
        elif isinstance(msg, EmbeddingMsg):
            for out in msg.outs:
                inbox = self._inboxes.get(out.rid)
                if inbox is not None:
                    inbox.push(out)
        elif isinstance(msg, ErrorMsg):
            if self.observer is not None:
                self.observer.reply(msg)
            inbox = self._inboxes.get(msg.rid)
            if inbox is not None:
                inbox.push(msg)
        elif isinstance(msg, (StatsMsg, TokensMsg, DetokenizedMsg, QueryErrorMsg, LoraAdapterReplyMsg)):
            future = self._queries.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg)
        else:
            logger.warning("frontend: ignoring unexpected message %s", type(msg).__name__)
