"""Command line -> `ServerConfig` (composed of the engine and scheduler configs, whose flags
live in `engine_args.py`, shared with `python -m minisgl.bench offline`).

Bad options end the program with one line that says what to change, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from minisgl.engine.config import EngineConfig
from minisgl.env import API_KEY_VAR, ENV
from minisgl.scheduler.config import SchedulerConfig
from minisgl.tokenizer.reasoning import REASONING_PARSERS
from minisgl.server.engine_args import (
    add_engine_args,
    check_engine_args,
    engine_config,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    scheduler_config,
)

PROG = "python -m minisgl"


@dataclass(frozen=True)
class ParallelConfig:
    """How one launch spreads over processes and machines; the TP size is `EngineConfig.tp_size`.

    `dp_size` replicas each run `tp_size` scheduler ranks; with `nnodes` > 1 each node runs
    tp_size / nnodes ranks of every replica, node 0 also the API server, tokenizer and
    detokenizer. `dist_init_addr` is node 0's rendezvous store (host, port)."""

    dp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.nnodes < 1:
            raise ValueError("--dp and --nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}] with --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")

    @property
    def is_head(self) -> bool:
        """Node 0: the API server, tokenizer and detokenizer run here."""
        return self.node_rank == 0


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    shell: bool = False
    served_model_name: str | None = None
    startup_timeout: float = 600.0
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    # Overload, deadlines and shutdown (server/admission.py). None: unbounded / no deadline.
    max_queued_requests: int | None = None
    request_timeout: float | None = None
    shutdown_timeout: float = 10.0
    # Beyond chat (docs/reasoning.md, docs/responses_api.md).
    reasoning_parser: str | None = None  # tokenizer/reasoning.py REASONING_PARSERS
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id and GET (LRU)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see '{PROG} --help')")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit."""
    print(f"minisgl: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, number = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:port
    if not sep or not host or not number.isdigit() or not 0 < int(number) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1-65535, got {text!r}")
    return host, int(number)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="minisgl: an LLM inference engine with an OpenAI-compatible HTTP server "
        "(POST /v1/chat/completions, /v1/completions, /generate, /tokenize, /detokenize; GET /v1/models, "
        "/health, /metrics, /v1/internal/stats), or an interactive chat with --shell.",
    )
    groups = add_engine_args(p)
    groups.model.add_argument("--served-model-name", default=None,
                              help="name reported by /v1/models (default: from --model)")  # fmt: skip
    d = groups.device
    d.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas (each with --tp ranks) "
                   "behind one API server; a request goes to the replica with the fewest outstanding "
                   "tokens")  # fmt: skip
    d.add_argument("--nnodes", type=positive_int, default=1, help="machines one launch spans (run the same "
                   "command on each, with its --node-rank; --tp must be a multiple of it)")  # fmt: skip
    d.add_argument("--node-rank", type=non_negative_int, default=0,
                   help="this machine's index: 0 serves HTTP, the others run only scheduler ranks")  # fmt: skip
    d.add_argument("--dist-init-addr", type=_host_port, default=None, metavar="HOST:PORT",
                   help="node 0's address and a free port on it, where the nodes meet (torch.distributed "
                   "store); default with one node: a free port on 127.0.0.1")  # fmt: skip
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=port, default=30000, help="port to listen on (default: 30000; 0: any free)")
    s.add_argument("--startup-timeout", type=positive_float, default=600.0,
                   help="seconds to wait for every worker to be ready (default: 600)")  # fmt: skip
    s.add_argument("--shell", action="store_true", help="chat in the terminal instead of serving HTTP")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on "
                   f"every route but /health (default: ${API_KEY_VAR}, else no key)")  # fmt: skip
    s.add_argument("--cors-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins allowed to call the server from a browser ('*' for any)")  # fmt: skip
    a = p.add_argument_group("reasoning and responses")
    a.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="split chat replies into the thinking (message.reasoning_content, Anthropic thinking "
                   "blocks, Responses reasoning items) and the answer: qwen3 and deepseek_r1 read "
                   "<think>...</think>, gpt_oss reads harmony channels (default: no split)")  # fmt: skip
    a.add_argument("--max-stored-responses", type=non_negative_int, default=1000, metavar="N",
                   help="/v1/responses kept in memory for previous_response_id and GET, least recently "
                   "used dropped first; 0 keeps none (default: 1000)")  # fmt: skip
    r = p.add_argument_group("overload and shutdown")
    r.add_argument("--max-queued-requests", type=non_negative_int, default=None, metavar="N",
                   help="answer 503 (with Retry-After) at once to a generation request arriving while "
                   "--max-running-requests + N are in flight (default: no bound)")  # fmt: skip
    r.add_argument("--request-timeout", type=positive_float, default=None, metavar="S",
                   help="end a generation request still running after S seconds with an error "
                   "(504; an error event when streaming) and free its KV pages (default: none)")  # fmt: skip
    r.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0, metavar="S",
                   help="on SIGTERM / Ctrl-C: refuse new requests, let those in flight finish for up to S "
                   "seconds, then end the rest with an error (default: 10)")  # fmt: skip
    return p


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    problem = check_engine_args(args)
    if problem is not None:
        fail(problem)
    try:
        engine = engine_config(args)
        sched = scheduler_config(args)
        parallel = ParallelConfig(dp_size=args.dp, nnodes=args.nnodes, node_rank=args.node_rank,
                                  dist_init_addr=args.dist_init_addr)  # fmt: skip
    except ValueError as exc:
        fail(str(exc))
    if args.tp % args.nnodes:
        fail(f"--tp {args.tp} is not a multiple of --nnodes {args.nnodes}: every node runs --tp / --nnodes "
             "ranks of each replica")  # fmt: skip
    if args.shell and not parallel.is_head:
        fail("--shell runs on node 0 only (--node-rank 0)")
    if args.api_key is not None and not args.api_key.strip():
        fail("--api-key must not be empty")
    return ServerConfig(
        engine=engine, sched=sched, parallel=parallel, host=args.host, port=args.port, shell=args.shell,
        served_model_name=args.served_model_name, startup_timeout=args.startup_timeout,
        api_key=args.api_key or ENV.api_key, cors_origins=tuple(args.cors_origins),
        max_queued_requests=args.max_queued_requests, request_timeout=args.request_timeout,
        shutdown_timeout=args.shutdown_timeout, reasoning_parser=args.reasoning_parser,
        max_stored_responses=args.max_stored_responses,
    )  # fmt: skip
