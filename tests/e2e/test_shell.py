"""`python -m minisgl --shell` driven through a pseudo-terminal, like a person would."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from tests.e2e.service import REPO

PROMPT = ">>> "


class Terminal:
    def __init__(self, *args: str) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "minisgl", *args], stdin=slave, stdout=slave,
                                     stderr=slave, cwd=REPO, start_new_session=True)  # fmt: skip
        os.close(slave)
        self.buffer = ""

    def expect(self, needle: str, timeout: float = 240) -> str:
        """Read until `needle`; return everything before it and consume through it."""
        deadline = time.monotonic() + timeout
        while needle not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"waiting for {needle!r}; got:\n{self.buffer[-3000:]}"
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    self.buffer += os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    pass
        before, _, self.buffer = self.buffer.partition(needle)
        return before

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def test_shell_chat_history_and_reset():
    term = Terminal("--device", "cpu", "--shell")
    try:
        term.expect(PROMPT)
        term.send("Say hello in French.")
        answer = term.expect(PROMPT).replace("Say hello in French.", "").strip()
        assert answer, "the shell printed no answer"
        term.send("/history")
        history = term.expect(PROMPT)
        assert "[user] Say hello in French." in history and "[assistant]" in history
        term.send("And in Spanish?")
        term.expect(PROMPT)
        term.send("/history")
        history = term.expect(PROMPT)
        assert history.count("[user]") == 2 and history.count("[assistant]") == 2
        term.send("/reset")
        assert "cleared" in term.expect(PROMPT)
        term.send("/history")
        assert "(no history)" in term.expect(PROMPT)
        term.send("/exit")
        assert term.proc.wait(30) == 0
    finally:
        term.close()
