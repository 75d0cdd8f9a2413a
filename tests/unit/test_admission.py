"""Admission control (server/admission.py) around a stand-in ASGI app, and the API server's
reply-state backstop (server/frontend.py): no server, no model, each test well under a second."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from minisgl.core import SamplingParams
from minisgl.message.tokenizer import TextPrompt, TokenizeMsg, TokenPrompt
from minisgl.server.admission import AdmissionConfig, AdmissionGuard
from minisgl.server.frontend import FrontendAddrs, FrontendManager, _encoded

CHAT = "/v1/chat/completions"


class FakeClient:
    """One HTTP connection: sends a body once, then waits until told to disconnect."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.leave = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(next(m["headers"] for m in self.sent if m["type"] == "http.response.start"))

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def complete(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body") for m in self.sent)


class FakeApp:
    """Answers generation routes once `finish` is set (or the client is gone: 499, as the real
    handlers do); streaming responses send one event first."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.finish = asyncio.Event()
        self.saw_disconnect = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if scope["path"] != CHAT:
            await _json(send, 200, {"ok": True})
            return
        if self.stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        gone = asyncio.ensure_future(receive())
        finish = asyncio.ensure_future(self.finish.wait())
        await asyncio.wait({gone, finish}, return_when=asyncio.FIRST_COMPLETED)
        finish.cancel()
        if gone.done():
            self.saw_disconnect += 1
            if self.stream:
                await send({"type": "http.response.body", "body": b"data: late\n\n", "more_body": True})
            else:
                await _json(send, 499, {})
            return
        gone.cancel()
        if self.stream:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            await _json(send, 200, {"done": True})


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode(), "more_body": False})


def scope(path: str = CHAT, method: str = "POST") -> Scope:
    return {"type": "http", "path": path, "method": method, "headers": []}


async def start(guard: AdmissionGuard, path: str = CHAT, method: str = "POST") -> tuple[FakeClient, asyncio.Task[None]]:
    client = FakeClient()
    task = asyncio.create_task(guard(scope(path, method), client.receive, client.send))
    await asyncio.sleep(0.01)
    return client, task


def test_overload_is_503_at_once_and_other_routes_pass() -> None:
    async def main() -> None:
        app = FakeApp(stream=False)
        guard = AdmissionGuard(app, AdmissionConfig(max_in_flight=2))
        running = [await start(guard) for _ in range(2)]
        assert guard.in_flight == 2
        refused, task = await start(guard)
        await asyncio.wait_for(task, 1)
        assert refused.status == 503 and refused.headers[b"retry-after"] == b"1"
        err = json.loads(refused.body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and "overloaded" in err["message"]
        other, task = await start(guard, "/v1/models", "GET")  # not a generation route
        await asyncio.wait_for(task, 1)
        assert other.status == 200
        app.finish.set()
        for client, task in running:
            await asyncio.wait_for(task, 1)
            assert client.status == 200
        assert guard.in_flight == 0 and guard.counts.rejected == 1 and guard.counts.admitted == 2

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_answers_the_client_and_disconnects_the_app(stream: bool) -> None:
    async def main() -> None:
        app = FakeApp(stream)
        guard = AdmissionGuard(app, AdmissionConfig(request_timeout=0.1))
        client, task = await start(guard)
        await asyncio.wait_for(task, 2)
        assert app.saw_disconnect == 1 and guard.in_flight == 0 and guard.counts.timed_out == 1
        assert client.complete
        if stream:  # the event sent before, then the error event and [DONE]; the app's late one dropped
            assert client.status == 200
            events = [e for e in client.body.decode().split("\n\n") if e]
            assert events[0] == "data: 1" and events[-1] == "data: [DONE]"
            assert json.loads(events[1][len("data: "):])["error"]["code"] == "timeout"
            assert b"late" not in client.body
        else:
            assert client.status == 504 and json.loads(client.body)["error"]["type"] == "timeout_error"
            assert [m["type"] for m in client.sent].count("http.response.start") == 1  # the app's 499 dropped

    asyncio.run(main())


def test_no_timeout_for_a_request_that_finishes() -> None:
    async def main() -> None:
        app = FakeApp(stream=True)
        guard = AdmissionGuard(app, AdmissionConfig(request_timeout=0.3))
        client, task = await start(guard)
        app.finish.set()
        await asyncio.wait_for(task, 1)
        await asyncio.sleep(0.4)
        assert client.body == b"data: 1\n\ndata: [DONE]\n\n" and guard.counts.timed_out == 0

    asyncio.run(main())


def test_drain_refuses_new_work_waits_then_ends_the_rest() -> None:
    async def main() -> None:
        app = FakeApp(stream=True)
        guard = AdmissionGuard(app, AdmissionConfig())
        client, task = await start(guard)
        drain = asyncio.create_task(guard.drain(0.3))
        await asyncio.sleep(0.05)
        refused, t2 = await start(guard)
        health, t3 = await start(guard, "/health", "GET")
        await asyncio.wait_for(asyncio.gather(t2, t3), 1)
        assert refused.status == 503 and b"shutting down" in refused.body
        assert health.status == 503 and json.loads(health.body) == {"status": "draining"}
        assert await asyncio.wait_for(drain, 3) == 1  # still running at the deadline: ended
        await asyncio.wait_for(task, 1)
        assert b"shut down before the request finished" in client.body and client.body.endswith(b"data: [DONE]\n\n")
        assert guard.in_flight == 0

        guard2 = AdmissionGuard(FakeApp(stream=False), AdmissionConfig())
        client2, task2 = await start(guard2)
        drain2 = asyncio.create_task(guard2.drain(5.0))
        await asyncio.sleep(0.05)
        assert isinstance(guard2.app, FakeApp)
        guard2.app.finish.set()  # finishes within the drain: answered in full, nothing ended
        assert await asyncio.wait_for(drain2, 2) == 0
        await task2
        assert client2.status == 200 and json.loads(client2.body) == {"done": True}

    asyncio.run(main())


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(max_in_flight=0)
    with pytest.raises(ValueError):
        AdmissionConfig(request_timeout=0)


def test_reply_state_goes_with_the_request_task(tmp_path: Path) -> None:
    """A handler that fails after opening its inbox leaves nothing behind (frontend backstop)."""

    async def main() -> None:
        addr = f"ipc://{tmp_path}"
        fm = FrontendManager(FrontendAddrs(recv=f"{addr}/f", tokenizer=f"{addr}/t", scheduler=f"{addr}/s"))

        async def handler() -> None:
            fm.open(3)
            raise RuntimeError("failed after opening")

        with pytest.raises(RuntimeError):
            await asyncio.create_task(handler())
        await asyncio.sleep(0)
        assert fm.live_requests == 0
        await fm.close()

    asyncio.run(main())


def test_integers_beyond_the_wire_are_a_client_error(tmp_path: Path) -> None:
    assert _encoded([TokenizeMsg(1, TextPrompt("x"), SamplingParams(seed=2**63 - 1))]) is not None
    # (SamplingParams itself refuses a seed beyond int64: a token id is what reaches the wire)
    assert _encoded([TokenizeMsg(1, TokenPrompt([1, 2**64]), SamplingParams())]) is None

    async def main() -> None:
        addr = f"ipc://{tmp_path}"
        fm = FrontendManager(FrontendAddrs(recv=f"{addr}/f", tokenizer=f"{addr}/t", scheduler=f"{addr}/s"))
        inbox = fm.open(1)
        await fm.submit([TokenizeMsg(inbox.rids[0], TokenPrompt([2**64]), SamplingParams())])
        (reply,) = inbox.take()
        assert reply.status == 400 and "out of range" in reply.message  # type: ignore[union-attr]
        fm.release(inbox)
        await fm.close()

    asyncio.run(main())
