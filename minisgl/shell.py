"""`python -m minisgl --shell`: a multi-turn chat in the terminal.

It is a front end of the same service as the HTTP server, on the same path: each turn is a chat
completion body validated by the server's `ChatCompletionRequest`, turned into `TokenizeMsg`s
by the same function as the `/v1/chat/completions` route (`server.request_msgs`), and its replies
are routed by the server's `FrontendManager` (one inbox per request, abort on release). Each turn
sends the whole conversation (the prefix cache makes the repeated part cheap) and streams the
answer as it is decoded.
Commands: /reset (forget the conversation), /history, /help, /exit (or Ctrl-D). Ctrl-C stops
the answer being generated.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any, Protocol

from minisgl.message.frontend import ErrorMsg
from minisgl.server.chat_protocol import ChatCompletionRequest
from minisgl.server.frontend import FrontendAddrs, FrontendManager
from minisgl.server.protocol import RequestError, parse_request
from minisgl.server.request_msgs import chat_msgs

HELP = "commands: /reset forget the conversation, /history show it, /help, /exit (or Ctrl-D); Ctrl-C stops an answer"
MAX_ANSWER_TOKENS = 512  # a ceiling (like a chat body without max_tokens): lowered to fit the context


class Service(Protocol):
    """What the shell needs of the launched workers (`server.processes.ServiceProcesses`)."""

    frontend_addrs: FrontendAddrs

    def start_watchdog(self, on_death: Callable[[str], None]) -> None: ...

    def shutdown(self, grace: float = 3.0) -> None: ...


class ChatShell:
    def __init__(self, fm: FrontendManager, loop: asyncio.AbstractEventLoop, out: Any = sys.stdout,
                 body: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.fm = fm
        self.loop = loop
        self.out = out
        self.body = body if body is not None else {"temperature": 0}  # fields of each turn's request
        self.history: list[dict[str, str]] = []

    def say(self, text: str, end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def command(self, line: str) -> bool:
        """Handle a /command; False means leave the shell."""
        cmd = line.split()[0].lower()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/reset":
            self.history.clear()
            self.say("(conversation cleared)")
        elif cmd == "/history":
            if not self.history:
                self.say("(no history)")
            for m in self.history:
                self.say(f"[{m['role']}] {m['content']}")
        elif cmd == "/help":
            self.say(HELP)
        else:
            self.say(f"unknown command {cmd}; {HELP}")
        return True

    def turn(self, text: str) -> None:
        """Send the conversation plus `text`; stream the answer; keep both in the history."""
        self.history.append({"role": "user", "content": text})
        answer: list[str] = []
        task = self.loop.create_task(self._ask(answer))
        try:
            error = self.loop.run_until_complete(task)
        except KeyboardInterrupt:
            task.cancel()  # its `finally` releases the inbox: the request is aborted
            self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            self.say(" [stopped]", end="")
            error = None
        if error is not None:
            self.say(f"error: {error}")
            self.history.pop()
            return
        self.say("")
        self.history.append({"role": "assistant", "content": "".join(answer)})

    async def _ask(self, answer: list[str]) -> str | None:
        """One chat completion, streamed into `answer`; the error message if it was refused."""
        body = {**self.body, "messages": list(self.history), "stream": True}
        try:
            req: ChatCompletionRequest = parse_request(ChatCompletionRequest, json.dumps(body).encode())
            sampling, explicit = req.sampling(MAX_ANSWER_TOKENS)
        except RequestError as exc:
            return str(exc)
        inbox = self.fm.open(req.n)
        try:
            await self.fm.submit(chat_msgs(req, inbox.rids, sampling, explicit))
            async for replies in self.fm.replies(inbox):
                for reply in replies:
                    if isinstance(reply, ErrorMsg):
                        return reply.message
                    answer.append(reply.text)
                    self.say(reply.text, end="")
            return None
        finally:
            self.fm.release(inbox)

    def loop_forever(self, banner: str = "minisgl chat") -> None:
        self.say(f"{banner}. {HELP}")
        while True:
            try:
                line = input(">>> ").strip()
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:
                self.say("\n(use /exit or Ctrl-D to leave)")
                continue
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.turn(line)


def run_shell(procs: Service, served: str) -> int:
    """Chat with the service's workers until the user leaves; returns the exit code."""
    import os

    loop = asyncio.new_event_loop()
    fm = FrontendManager(procs.frontend_addrs)

    def on_death(name: str) -> None:
        sys.stderr.write(f"\nminisgl: error: the {name} process died; leaving the shell\n")
        sys.stderr.flush()
        procs.shutdown(grace=1.0)
        os._exit(1)

    async def start() -> None:
        fm.start()

    procs.start_watchdog(on_death)
    loop.run_until_complete(start())
    try:
        ChatShell(fm, loop).loop_forever(f"minisgl chat with {served}")
    finally:
        loop.run_until_complete(fm.close())
        loop.close()
    return 0
