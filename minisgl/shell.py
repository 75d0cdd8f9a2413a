"""`python -m minisgl --shell`: a multi-turn chat in the terminal.

It talks to the same tokenizer, scheduler and detokenizer processes as the HTTP server, through
the same messages, one request at a time: each turn sends the whole conversation (the prefix
cache makes the repeated part cheap) and streams the answer as it is decoded.
Commands: /reset (forget the conversation), /history, /help, /exit (or Ctrl-D). Ctrl-C stops
the answer being generated.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams
from minisgl.message.frontend import ErrorMsg, TextDeltaMsg
from minisgl.message.scheduler import AbortMsg
from minisgl.message.tokenizer import ChatPrompt, TokenizeMsg
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

if TYPE_CHECKING:
    from minisgl.server.launch import ServiceProcesses

HELP = "commands: /reset forget the conversation, /history show it, /help, /exit (or Ctrl-D); Ctrl-C stops an answer"
MAX_ANSWER_TOKENS = 512


class ChatShell:
    def __init__(self, recv: ZmqPullQueue[object], to_tokenizer: ZmqPushQueue[object],
                 sampling: SamplingParams, out: Any = sys.stdout) -> None:  # fmt: skip
        self.recv = recv
        self.to_tokenizer = to_tokenizer
        self.sampling = sampling
        self.out = out
        self.history: list[dict[str, str]] = []
        self._next_rid = 0

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
        rid = self._next_rid
        self._next_rid += 1
        self.history.append({"role": "user", "content": text})
        self.to_tokenizer.put(TokenizeMsg(rid, ChatPrompt(list(self.history)), self.sampling, False, []))
        answer: list[str] = []
        try:
            while True:
                msg = self.recv.get()
                if isinstance(msg, ErrorMsg) and msg.rid == rid:
                    self.say(f"error: {msg.message}")
                    self.history.pop()
                    return
                if not isinstance(msg, TextDeltaMsg):
                    continue
                finished = False
                for delta in msg.deltas:
                    if delta.rid != rid:
                        continue  # a late reply of an interrupted turn
                    answer.append(delta.text)
                    self.say(delta.text, end="")
                    finished = finished or delta.finish_reason is not None
                if finished:
                    break
        except KeyboardInterrupt:
            self.to_tokenizer.put(AbortMsg(rid))
            self.say(" [stopped]", end="")
        self.say("")
        self.history.append({"role": "assistant", "content": "".join(answer)})

    def loop(self, banner: str = "minisgl chat") -> None:
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


def run_shell(procs: ServiceProcesses, served: str) -> int:
    """Chat with the service's workers until the user leaves; returns the exit code."""
    import os

    addrs = procs.frontend_addrs
    recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv)
    to_tokenizer: ZmqPushQueue[object] = ZmqPushQueue(addrs.tokenizer)

    def on_death(name: str) -> None:
        sys.stderr.write(f"\nminisgl: error: the {name} process died; leaving the shell\n")
        sys.stderr.flush()
        procs.shutdown(grace=1.0)
        os._exit(1)

    procs.start_watchdog(on_death)
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    try:
        ChatShell(recv, to_tokenizer, sampling).loop(f"minisgl chat with {served}")
    finally:
        recv.close()
        to_tokenizer.close()
    return 0
