"""The launcher: start every process, wait until all are ready, serve, and tear everything down.

Node 0 (the only node without `--nnodes`) runs the API server (or the shell) in the launcher
itself, with the children of `processes.py`: scheduler ranks, a tokenizer and a detokenizer. With
`--tp` > 1 it also hosts the launch's rendezvous store (`cluster.py`). Other nodes run only their
scheduler ranks and follow node 0 through the store: they stop when it stops. Ctrl-C / SIGTERM
tear all children down; children also exit by themselves when their launcher disappears.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from minisgl.server.args import ServerConfig, fail, parse_args
from minisgl.server.processes import ServiceProcesses, StartupError
from minisgl.utils.logging import get_logger

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig
    from minisgl.server.cluster import Cluster

__all__ = ["ServiceProcesses", "StartupError", "main"]

logger = get_logger(__name__)


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
    model_dir, model_config = _load_model_config(config)
    context_len = model_config.serving_context_len(config.engine.max_model_len)
    if not config.parallel.is_head:
        sys.exit(_run_node(config, model_dir, model_config))
    served = config.served_model_name or _default_name(config.engine.model, model_dir)
    if config.shell:  # the terminal is for the conversation
        logging.getLogger("minisgl").setLevel(logging.WARNING)
        print(f"loading {served}...", flush=True)
    sock = None if config.shell else _bind(config.host, config.port)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    cluster = _join_cluster(config, model_config)
    procs = ServiceProcesses(config, model_dir, context_len, cluster)
    poll = cluster.failure if cluster is not None and config.parallel.nnodes > 1 else None
    code = 0
    try:
        procs.start()
        procs.wait_ready(config.startup_timeout, poll)
        reported = min(procs.info(name).get("context_len", context_len) for name in procs.replica_of)
        if reported != context_len:
            logger.warning("the engine uses a context of %d tokens, the tokenizer checks %d", reported, context_len)
        context_len = min(context_len, reported)
        if config.shell:
            from minisgl.shell import run_shell

            code = run_shell(procs, served)
        else:
            assert sock is not None
            code = _serve(config, procs, sock, served, context_len, poll)
    except StartupError as exc:
        logger.error("%s", exc)
        print(f"minisgl: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        logger.info("interrupted: shutting down")
    finally:
        _teardown(procs, cluster, sock)
    sys.exit(code)


def _teardown(procs: ServiceProcesses, announce: Cluster | None = None, sock: socket.socket | None = None) -> None:
    """Stop this node's service: ignore further signals, tell the other nodes (`announce`, node 0
    only), stop every child process, then close the listening socket (node 0's API server).

    Only node 0 passes its cluster: `Cluster.stop` tells the other nodes the launch is over. The
    other nodes only follow node 0 (their failures reach it through `Cluster.report_failure`)."""
    # A second Ctrl-C / SIGTERM must not interrupt the teardown itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if announce is not None:
        announce.stop()  # the other nodes stop their ranks too
    procs.shutdown()
    if sock is not None:
        sock.close()


def _load_model_config(config: ServerConfig) -> tuple[str, ModelConfig]:
    """The model's directory and facts; a model that TP cannot split fails here, before any
    process starts."""
    from minisgl.distributed.layout import ShardedDims, check_tp_size
    from minisgl.models.config import ModelConfig
    from minisgl.models.source import ModelSourceError, resolve_model_dir

    try:
        # Config and tokenizer suffice here; a GGUF's float32 weights, if the engine wants them,
        # are converted by the engine (--weights gguf reads the file's blocks instead).
        model_dir = str(resolve_model_dir(config.engine.model, float_weights=False))
        model_config = ModelConfig.from_dir(model_dir)
    except (ModelSourceError, ValueError, OSError, KeyError) as exc:
        fail(f"cannot load model {config.engine.model or '(default)'}: {exc}")
    mc = model_config
    dense = any(not mc.is_sparse_layer(layer) for layer in range(mc.num_layers))
    dims = ShardedDims(mc.num_heads, mc.num_kv_heads, mc.intermediate_size if dense else 0, mc.moe_intermediate_size)
    try:
        check_tp_size(dims, config.engine.tp_size)
    except ValueError as exc:
        fail(str(exc))
    return model_dir, model_config


def _join_cluster(config: ServerConfig, model_config: ModelConfig) -> Cluster | None:
    """The rendezvous store (hosted on node 0, joined elsewhere); None without TP."""
    if config.engine.tp_size == 1:
        return None
    from minisgl.server.cluster import Cluster, launch_settings

    mc = model_config
    settings = launch_settings(config, [mc.architecture, mc.vocab_size, mc.hidden_size, mc.num_layers,
                                        mc.num_heads, mc.num_kv_heads])  # fmt: skip
    try:
        return Cluster(config.parallel, settings, config.startup_timeout)
    except ValueError as exc:
        fail(str(exc), 1)


def _run_node(config: ServerConfig, model_dir: str, model_config: ModelConfig) -> int:
    """A node other than 0: run this node's scheduler ranks until node 0 stops."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    cluster = _join_cluster(config, model_config)
    assert cluster is not None  # --nnodes > 1 implies --tp > 1
    procs = ServiceProcesses(config, model_dir, 0, cluster)
    node = config.parallel.node_rank
    code = 0
    try:
        procs.start()
        procs.wait_ready(config.startup_timeout, lambda: None if cluster.head_state() == "running" else "node 0 left")
        logger.info("node %d: %s ready; following node 0 at %s:%d", node, ", ".join(procs.replica_of),
                    cluster.host, cluster.port)  # fmt: skip
        while True:
            dead = procs.wait_any_exit(0.5)
            state = cluster.head_state()
            if state == "stopped":
                logger.info("node 0 stopped: shutting down")
                break
            if state == "gone":
                print(f"minisgl: error: lost node 0 ({cluster.host}:{cluster.port}); node {node} stops",
                      file=sys.stderr, flush=True)  # fmt: skip
                code = 1
                break
            if dead is not None:
                logger.error("%s (pid %s) died with exit code %s", dead.name, dead.process.pid, dead.process.exitcode)
                cluster.report_failure(dead.name)
                print(f"minisgl: error: the {dead.name} process died; node {node} stops", file=sys.stderr, flush=True)
                code = 1
                break
    except StartupError as exc:
        cluster.report_failure(str(exc))
        print(f"minisgl: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        logger.info("interrupted: shutting down")
    finally:
        _teardown(procs)  # not the cluster: only node 0 announces the end of the launch
    return code


def _default_name(model: str | None, model_dir: str) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = Path(model.rstrip("/")).name
    return name.removesuffix(".gguf") or Path(model_dir).name


def _serve(config: ServerConfig, procs: ServiceProcesses, sock: socket.socket, served: str, context_len: int,
           poll: Callable[[], str | None] | None) -> int:  # fmt: skip
    import uvicorn

    from minisgl.server.admission import AdmissionConfig, DrainingServer, guard_app
    from minisgl.server.api_server import AppState, create_app
    from minisgl.server.lora_registry import LoraRegistry

    state = AppState(procs.frontend_addrs, served, context_len, procs.health, started=int(time.time()),
                     api_key=config.api_key, cors_origins=list(config.cors_origins),
                     reasoning_parser=config.reasoning_parser, max_stored_responses=config.max_stored_responses,
                     lora=LoraRegistry(config.engine.lora, dict(config.engine.lora_modules)))  # fmt: skip
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

    procs.start_watchdog(on_death, poll)
    host, port = sock.getsockname()[:2]
    logger.info("serving %s on http://%s:%d (context %d tokens)", served, host, port, context_len)
    server.run(sockets=[sock])
    if failed:
        print(f"minisgl: error: the {failed[0]} process died; the service stopped", file=sys.stderr, flush=True)
        return 1
    return 0
