"""Helpers for the launcher's child processes: start-up reports and lifetime tied to the parent.

A child runs `child_main(name, conn, target, kwargs)` (spawned, so it starts from a clean
interpreter). The target gets a `ReadyReporter` and calls `ready(**info)` once it can serve; any
exception before that is reported back with its message so the launcher can name the failing
child. Children ignore Ctrl-C (the launcher owns shutdown), exit on SIGTERM, and exit by
themselves if the launcher disappears, so no child outlives the service.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

_PR_SET_PDEATHSIG = 1


class ReadyReporter:
    """The child's end of the start-up pipe. Sends ("ready", info) or ("error", text) once."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._sent = False

    def ready(self, **info: Any) -> None:
        self._send(("ready", info))

    def failed(self, error: str) -> None:
        self._send(("error", error))

    def _send(self, item: tuple[str, Any]) -> None:
        if self._sent:
            return
        self._sent = True
        try:
            self._conn.send(item)
            self._conn.close()
        except OSError:  # the launcher is gone; the parent watch will end us
            pass


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def watch_parent(poll_s: float = 0.5) -> None:
    """Exit this process as soon as its parent is gone (killed, crashed, or exited)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:  # the kernel signals us when the parent dies; the thread below is the fallback
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # died between fork and prctl
        os._exit(1)

    def poll() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def child_main(
    name: str, conn: Connection, target: Callable[..., None], kwargs: dict[str, Any], log_level: str | None = None
) -> None:
    """Entry point of every spawned child. `log_level` overrides the level of minisgl's loggers."""
    if log_level is not None:
        logging.getLogger("minisgl").setLevel(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    watch_parent()
    reporter = ReadyReporter(conn)
    try:
        target(ready=reporter, **kwargs)
    except SystemExit:
        raise
    except BaseException as exc:  # report start-up failures, then die loudly
        reporter.failed(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, ValueError):  # a user error (bad option, bad model): one line is enough
            logger.error("%s failed: %s", name, exc)
        else:
            logger.error("%s crashed:\n%s", name, traceback.format_exc())
        sys.exit(1)
