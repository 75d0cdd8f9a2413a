"""The scheduler process: receive requests and aborts, run steps, send new tokens onward.

Rank 0 receives from the tokenizer (requests, aborts), the detokenizer (stop-string aborts) and
the API server (stats queries). With tensor parallelism it relays the raw bytes it received to
every other rank once per loop iteration, even when empty, so all ranks apply the same messages
between the same steps and schedule identically. Only rank 0 sends results.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from minisgl.engine.config import EngineConfig
from minisgl.message.codec import decode
from minisgl.message.frontend import ErrorMsg, StatsMsg
from minisgl.message.scheduler import AbortMsg, ShutdownMsg, StatsReqMsg, TokenizedMsg
from minisgl.message.tokenizer import TokenOut, TokenOutMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.logging import get_logger
from minisgl.utils.process import ReadyReporter
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

logger = get_logger(__name__)

_RELAY_HEADER = b"minisgl-step"


@dataclass(frozen=True)
class SchedulerAddrs:
    recv: str  # where this rank receives: requests (rank 0) or relayed bytes (other ranks)
    detokenizer: str  # rank 0 sends TokenOutMsg / ErrorMsg here
    frontend: str  # rank 0 answers stats queries here
    relay: tuple[str, ...] = field(default_factory=tuple)  # rank 0: the other ranks' `recv`


class SchedulerLoop:
    """The message handling around `Scheduler.step`, separate from process set-up for tests."""

    def __init__(self, scheduler: Scheduler, addrs: SchedulerAddrs, rank: int) -> None:
        self.scheduler = scheduler
        self.rank = rank
        self.recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv)
        self.primary = rank == 0
        self.relay = [ZmqPushQueue[object](addr) for addr in addrs.relay] if self.primary else []
        self.to_detok: ZmqPushQueue[object] | None = ZmqPushQueue(addrs.detokenizer) if self.primary else None
        self.to_frontend: ZmqPushQueue[object] | None = ZmqPushQueue(addrs.frontend) if self.primary else None
        self.running = True
        # Tokens the KV pool can hold at all: the ceiling of a request with no max_tokens.
        self.pool_tokens = scheduler.stats().total_pages * scheduler.page_size
        # Prompt tokens of every request that produced its first token, and the prefix-cache hits
        # among them (the /metrics hit rate).
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def run(self) -> None:
        while self.running:
            self.run_once()

    def run_once(self) -> None:
        outs: list[TokenOut] = []
        for msg in self._receive():
            self._handle(msg, outs)
        if self.scheduler.has_work():
            for out in self.scheduler.step():
                if out.output_tokens == 1 and out.token_ids:
                    self.prompt_tokens += out.prompt_tokens
                    self.cached_tokens += out.cached_tokens
                outs.append(
                    TokenOut(out.rid, out.token_ids, out.finish_reason,  # type: ignore[arg-type]
                             out.prompt_tokens, out.cached_tokens, out.output_tokens,
                             out.logprobs, out.prompt_logprobs)
                )
        if outs and self.to_detok is not None:
            self.to_detok.put(TokenOutMsg(outs))

    def _receive(self) -> list[object]:
        if not self.primary:
            frames = self.recv.get_raw_multipart()
            return [decode(raw) for raw in frames[1:]]
        raws = self.recv.drain_raw()
        if not raws and not self.scheduler.has_work():
            raws = [self.recv.get_raw()] + self.recv.drain_raw()  # idle: block for work
        for queue in self.relay:
            queue.put_raw([_RELAY_HEADER, *raws])
        return [decode(raw) for raw in raws]

    def _handle(self, msg: object, outs: list[TokenOut]) -> None:
        if isinstance(msg, TokenizedMsg):
            sampling = msg.sampling
            if not msg.max_tokens_explicit:
                room = max(self.pool_tokens - len(msg.input_ids), sampling.min_tokens)
                if 0 < room < sampling.max_tokens:
                    sampling = replace(sampling, max_tokens=room)
            try:
                self.scheduler.add_request(msg.rid, msg.input_ids, sampling)
            except ValueError as exc:
                if self.to_detok is not None:
                    self.to_detok.put(ErrorMsg(msg.rid, str(exc), 400))
        elif isinstance(msg, AbortMsg):
            if self.scheduler.abort(msg.rid):
                if self.primary:
                    logger.info("Aborting request %d", msg.rid)
                # The detokenizer drops its state for the request on this final output.
                outs.append(TokenOut(msg.rid, [], "abort"))
        elif isinstance(msg, StatsReqMsg):
            if self.to_frontend is not None:
                s = self.scheduler.stats()
                self.to_frontend.put(
                    StatsMsg(msg.query_id, s.total_pages, s.free_pages, s.cached_pages, s.evictable_pages,
                             s.running, s.waiting, self.prompt_tokens, self.cached_tokens)
                )
        elif isinstance(msg, ShutdownMsg):
            self.running = False
        else:
            logger.warning("scheduler: ignoring unexpected message %s", type(msg).__name__)

    def close(self) -> None:
        self.recv.close()
        for queue in self.relay:
            queue.close()
        for q in (self.to_detok, self.to_frontend):
            if q is not None:
                q.close()


def _init_tensor_parallel(engine_config: EngineConfig, dist_port: int | None) -> EngineConfig:
    """Join the TP process group (rank r on cuda:r when on GPU); returns the per-rank config."""
    if engine_config.tp_size == 1:
        return engine_config
    import torch
    import torch.distributed as dist

    from minisgl.platform import init_platform

    rank, size = engine_config.tp_rank, engine_config.tp_size
    device = engine_config.device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        device = f"cuda:{rank}"
    platform = init_platform(device)
    if dist_port is None:
        raise ValueError("tensor parallelism needs a rendezvous port")
    dist.init_process_group(
        backend=platform.dist_backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=size
    )
    return replace(engine_config, device=device)


def run_scheduler(
    engine_config: EngineConfig,
    sched_config: SchedulerConfig,
    addrs: SchedulerAddrs,
    ready: ReadyReporter,
    dist_port: int | None = None,
) -> None:
    """Process entry point of one TP rank: build the scheduler (loads the model), report ready,
    then serve until told to stop."""
    import torch

    from minisgl.scheduler.scheduler import Scheduler

    engine_config = _init_tensor_parallel(engine_config, dist_port)
    with torch.inference_mode():
        scheduler = Scheduler(engine_config, sched_config)
        loop = SchedulerLoop(scheduler, addrs, engine_config.tp_rank)
        ready.ready(context_len=scheduler.context_len, total_pages=scheduler.stats().total_pages)
        try:
            loop.run()
        finally:
            loop.close()
