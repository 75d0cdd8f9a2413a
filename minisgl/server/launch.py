"""The launcher: start every process, wait until all are ready, serve, and tear everything down.

Processes (all spawned, so none inherits the launcher's threads, sockets or a device context):
one scheduler per TP rank, a tokenizer and a detokenizer. The launcher itself runs the API
server (or the shell). A watchdog thread waits on every child; if one dies the whole service
goes down with its name in the log. Ctrl-C / SIGTERM tear all children down; children also exit
by themselves when the launcher disappears.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable

from minisgl.scheduler.process import SchedulerAddrs, run_scheduler
from minisgl.server.args import ServerConfig, fail, parse_args
from minisgl.server.frontend import FrontendAddrs
from minisgl.tokenizer.detokenizer import DetokenizerAddrs, run_detokenizer
from minisgl.tokenizer.worker import TokenizerAddrs, run_tokenizer
from minisgl.utils.logging import get_logger
from minisgl.utils.process import child_main
from minisgl.utils.zmq import IpcDir

logger = get_logger(__name__)


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: BaseProcess
    conn: Connection  # the launcher's end of the start-up pipe
    info: dict[str, Any] | None = None


class ServiceProcesses:
    """Owns the children of one launch: start, wait for ready, watch, tear down."""

    def __init__(self, config: ServerConfig, model_dir: str, context_len: int) -> None:
        self.config = config
        self.ipc = IpcDir()
        tp = config.engine.tp_size
        rank_addrs = [self.ipc.addr("scheduler")] + [self.ipc.addr(f"scheduler-{r}") for r in range(1, tp)]
        a = {name: self.ipc.addr(name) for name in ("tokenizer", "detokenizer", "frontend")}
        self.frontend_addrs = FrontendAddrs(recv=a["frontend"], tokenizer=a["tokenizer"], scheduler=rank_addrs[0])
        self._specs: list[tuple[str, Callable[..., None], dict[str, Any]]] = []
        engine = replace(config.engine, model=model_dir)
        dist_port = _free_port() if tp > 1 else None
        for rank in range(tp):
            addrs = SchedulerAddrs(recv=rank_addrs[rank], detokenizer=a["detokenizer"], frontend=a["frontend"],
                                   relay=tuple(rank_addrs[1:]) if rank == 0 else ())  # fmt: skip
            kwargs = dict(engine_config=replace(engine, tp_rank=rank), sched_config=config.sched, addrs=addrs,
                          dist_port=dist_port)  # fmt: skip
            self._specs.append((f"scheduler-{rank}", run_scheduler, kwargs))
        tok = TokenizerAddrs(recv=a["tokenizer"], scheduler=rank_addrs[0], detokenizer=a["detokenizer"],
                             frontend=a["frontend"])  # fmt: skip
        self._specs.append(("tokenizer", run_tokenizer, dict(model_dir=model_dir, context_len=context_len, addrs=tok)))
        detok = DetokenizerAddrs(recv=a["detokenizer"], scheduler=rank_addrs[0], frontend=a["frontend"])
        self._specs.append(("detokenizer", run_detokenizer, dict(model_dir=model_dir, addrs=detok)))
        self.children: list[Child] = []
        # The shell keeps the terminal for the conversation: workers only log warnings there.
        self.log_level: str | None = "WARNING" if config.shell else None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for name, target, kwargs in self._specs:
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child_main, args=(name, child_end, target, kwargs, self.log_level),
                               name=f"minisgl-{name}")  # fmt: skip
            proc.start()
            child_end.close()
            self.children.append(Child(name, proc, parent_end))
            logger.info("started %s (pid %d)", name, proc.pid)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {c.name: c for c in self.children}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupError(f"timed out after {timeout:.0f} s waiting for {', '.join(pending)} to start "
                                   "(raise --startup-timeout if the model is slow to load)")  # fmt: skip
            handles: list[Any] = [c.conn for c in pending.values()] + [c.process.sentinel for c in pending.values()]
            ready = wait(handles, timeout=min(left, 1.0))
            for child in list(pending.values()):
                if child.conn in ready or child.process.sentinel in ready:
                    report = self._read_report(child)
                    if report is None:
                        child.process.join(1.0)
                        raise StartupError(f"{child.name} exited with code {child.process.exitcode} during start-up")
                    kind, payload = report
                    if kind == "error":
                        raise StartupError(f"{child.name} failed to start: {payload}")
                    child.info = payload
                    del pending[child.name]
                    logger.info("%s is ready", child.name)

    @staticmethod
    def _read_report(child: Child) -> tuple[str, Any] | None:
        try:
            if child.conn.poll(0.2):
                kind, payload = child.conn.recv()
                return kind, payload
        except (EOFError, OSError):
            pass
        return None

    def info(self, name: str) -> dict[str, Any]:
        return next(c.info or {} for c in self.children if c.name == name)

    # ------------------------------------------------------------------ running
    def health(self) -> tuple[bool, dict[str, Any]]:
        children = {c.name: {"pid": c.process.pid, "alive": c.process.is_alive()} for c in self.children}
        return all(v["alive"] for v in children.values()), {"pid": os.getpid(), "children": children}

    def start_watchdog(self, on_death: Callable[[str], None]) -> None:
        def watch() -> None:
            sentinels = {c.process.sentinel: c for c in self.children}
            ready = wait(list(sentinels))
            if self._stopping.is_set():
                return
            dead = sentinels[ready[0]]  # type: ignore[index]
            dead.process.join(0.5)
            logger.error("child process %s (pid %s) died unexpectedly with exit code %s; shutting the service down",
                         dead.name, dead.process.pid, dead.process.exitcode)  # fmt: skip
            on_death(dead.name)

        threading.Thread(target=watch, name="watchdog", daemon=True).start()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, grace: float = 3.0) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            for c in self.children:
                if c.process.is_alive():
                    c.process.terminate()
            deadline = time.monotonic() + grace
            for c in self.children:
                c.process.join(max(0.0, deadline - time.monotonic()))
            for c in self.children:
                if c.process.is_alive():
                    logger.warning("%s did not stop in %.0f s: killing it", c.name, grace)
                    c.process.kill()
                    c.process.join(2.0)
                c.conn.close()
            self.ipc.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fail(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host", 1)
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    from minisgl.models.source import ModelSourceError, resolve_model_dir

    try:
        model_dir = str(resolve_model_dir(config.engine.model))
        from minisgl.models.config import ModelConfig

        context_len = ModelConfig.from_dir(model_dir).serving_context_len(config.engine.max_model_len)
    except (ModelSourceError, ValueError, OSError, KeyError) as exc:
        fail(f"cannot load model {config.engine.model or '(default)'}: {exc}")
    served = config.served_model_name or _default_name(config.engine.model, model_dir)
    if config.shell:  # the terminal is for the conversation
        logging.getLogger("minisgl").setLevel(logging.WARNING)
        print(f"loading {served}...", flush=True)
    sock = None if config.shell else _bind(config.host, config.port)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    procs = ServiceProcesses(config, model_dir, context_len)
    code = 0
    try:
        procs.start()
        procs.wait_ready(config.startup_timeout)
        reported = procs.info("scheduler-0").get("context_len", context_len)
        if reported != context_len:
            logger.warning("the engine uses a context of %d tokens, the tokenizer checks %d", reported, context_len)
        context_len = min(context_len, reported)
        if config.shell:
            from minisgl.shell import run_shell

            code = run_shell(procs, served)
        else:
            assert sock is not None
            code = _serve(config, procs, sock, served, context_len)
    except StartupError as exc:
        logger.error("%s", exc)
        print(f"minisgl: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        logger.info("interrupted: shutting down")
    finally:
        # A second Ctrl-C / SIGTERM must not interrupt the teardown itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procs.shutdown()
        if sock is not None:
            sock.close()
    sys.exit(code)


def _default_name(model: str | None, model_dir: str) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = Path(model.rstrip("/")).name
    return name.removesuffix(".gguf") or Path(model_dir).name


def _serve(config: ServerConfig, procs: ServiceProcesses, sock: socket.socket, served: str, context_len: int) -> int:
    import uvicorn

    from minisgl.server.admission import AdmissionConfig, DrainingServer, guard_app
    from minisgl.server.api_server import AppState, create_app

    state = AppState(procs.frontend_addrs, served, context_len, procs.health, started=int(time.time()),
                     api_key=config.api_key, cors_origins=list(config.cors_origins))  # fmt: skip
    # Admission control (server/admission.py): in-flight bound, deadline, drain on SIGTERM.
    queued = config.max_queued_requests
    limit = None if queued is None else config.sched.max_running_requests + queued
    guard = guard_app(create_app(state), AdmissionConfig(limit, config.request_timeout))
    server = DrainingServer(uvicorn.Config(guard, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2, lifespan="on"),
                            guard, config.shutdown_timeout)  # fmt: skip
    failed: list[str] = []

    def on_death(name: str) -> None:
        failed.append(name)
        if state.frontend is not None:
            state.frontend.fail_all_threadsafe(f"the {name} process died; the service is shutting down")
        server.should_exit = True
        # If the graceful path stalls, do not hang: tear down and leave.
        def give_up() -> None:
            procs.shutdown(grace=1.0)
            os._exit(1)

        timer = threading.Timer(5.0, give_up)
        timer.daemon = True
        timer.start()

    procs.start_watchdog(on_death)
    host, port = sock.getsockname()[:2]
    logger.info("serving %s on http://%s:%d (context %d tokens)", served, host, port, context_len)
    server.run(sockets=[sock])
    if failed:
        print(f"minisgl: error: the {failed[0]} process died; the service stopped", file=sys.stderr, flush=True)
        return 1
    return 0
