"""The tokenizer process: chat template, tokenization and request validation.

For each `TokenizeMsg` it either rejects the request (`ErrorMsg` straight to the API server) or
sends `TokenizedMsg`, carrying what the detokenizer needs to know (`DetokFacts`: stop strings,
prompt tail, replica), to the scheduler of the replica the router picks (`router.py`; one replica
without `--dp`). The API server's aborts are forwarded to the request's replica on the same
socket as the requests, so a scheduler always sees a request before its abort.

The request logic is `RequestTokenizer` (request.py), which the offline `LLM` calls in-process.
It checks against the engine's own figures: rank 0 of every replica sends its `EngineLimitsMsg`
once its KV pool exists, and this process reports ready only when it has them all, so no request
(the API server opens after every child is ready) meets a tokenizer that does not know them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.message.codec import WIRE
from minisgl.message.frontend import ErrorMsg
from minisgl.message.scheduler import AbortMsg, LoraAdapterMsg, ShutdownMsg
from minisgl.message.tokenizer import (
    DetokenizeQueryMsg,
    EngineLimitsMsg,
    FinishedMsg,
    TokenizeMsg,
    TokenizeQueryMsg,
)
from minisgl.tokenizer.request import RequestTokenizer, load_hf_tokenizer
from minisgl.tokenizer.router import ReplicaRouter
from minisgl.utils.logging import get_logger
from minisgl.utils.memory import trim_heap
from minisgl.utils.process import ReadyReporter

if TYPE_CHECKING:
    from minisgl.utils.zmq import ZmqPullQueue

logger = get_logger(__name__)


@dataclass(frozen=True)
class TokenizerAddrs:
    recv: str  # requests, queries and aborts; the replicas' `EngineLimitsMsg`; with --dp their `FinishedMsg`
    schedulers: tuple[str, ...]  # rank 0 of each replica
    frontend: str


def engine_limits(reports: list[EngineLimitsMsg], context_len: int) -> EngineLimitsMsg:
    """What every replica can serve: the smallest of their figures (and of the launcher's
    context, as the API server uses the same minimum)."""
    return EngineLimitsMsg(
        context_len=min([context_len] + [r.context_len for r in reports]),
        vocab_size=min(r.vocab_size for r in reports),
        pool_tokens=min(r.pool_tokens for r in reports),
    )


def _await_limits(recv: ZmqPullQueue[object], replicas: int) -> list[EngineLimitsMsg] | None:
    """Every replica's limits (None: told to shut down first)."""
    reports: list[EngineLimitsMsg] = []
    while len(reports) < replicas:
        msg = recv.get()
        if isinstance(msg, EngineLimitsMsg):
            reports.append(msg)
        elif isinstance(msg, ShutdownMsg):
            return None
        else:
            logger.warning("tokenizer: ignoring %s before the engine's limits", type(msg).__name__)
    return reports


def run_tokenizer(model_dir: str, context_len: int, addrs: TokenizerAddrs, ready: ReadyReporter,
                  reasoning_parser: str | None = None) -> None:  # fmt: skip
    """Process entry point: `context_len` is the launcher's (from the model's config); the
    engine's own figures arrive from the schedulers before this process reports ready."""
    from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

    recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv, WIRE)
    to_scheds: list[ZmqPushQueue[object]] = [ZmqPushQueue(addr, WIRE) for addr in addrs.schedulers]
    router = ReplicaRouter(len(to_scheds))
    to_front: ZmqPushQueue[object] = ZmqPushQueue(addrs.frontend, WIRE)
    tokenizer = load_hf_tokenizer(model_dir)
    reports = _await_limits(recv, len(to_scheds))
    if reports is None:
        return
    worker = RequestTokenizer(tokenizer, engine_limits(reports, context_len), reasoning_parser)
    trim_heap()  # the tokenizer's load temporaries (utils/memory.py)
    ready.ready()
    while True:
        msg = recv.get()
        if isinstance(msg, TokenizeMsg):
            result = worker.handle(msg)
            if isinstance(result, ErrorMsg):
                to_front.put(result)
            else:
                replica = router.assign(msg.rid, len(result.input_ids) + result.sampling.max_tokens)
                if replica and result.facts is not None:
                    result.facts.replica = replica
                to_scheds[replica].put(result)
        elif isinstance(msg, (TokenizeQueryMsg, DetokenizeQueryMsg)):
            to_front.put(worker.query(msg))
        elif isinstance(msg, AbortMsg):
            owner = router.owner(msg.rid)
            if owner is not None:  # else it has ended already
                to_scheds[owner].put(msg)
        elif isinstance(msg, LoraAdapterMsg):  # on the request stream: after every request sent before it
            to_scheds[msg.replica].put(msg)
        elif isinstance(msg, FinishedMsg):
            router.finished(msg.rids)
        elif isinstance(msg, ShutdownMsg):
            break
        else:
            logger.warning("tokenizer: ignoring unexpected message %s", type(msg).__name__)

