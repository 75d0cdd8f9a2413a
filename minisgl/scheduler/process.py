"""The scheduler process: receive requests and aborts, run steps, send new tokens onward.

Rank 0 of each replica receives from the tokenizer (requests, and the API server's aborts routed
there by the tokenizer), from the detokenizer (stop-string aborts) and from the API server (stats
queries). It sends the detokenizer one `TokenOutMsg` per loop iteration: the facts of the
requests it admitted (`DetokFacts`, from their `TokenizedMsg`), then the step's outputs, so the
detokenizer knows a request before its first token on the same ordered stream. With tensor parallelism it relays the raw bytes it received to every other rank
once per loop iteration, even when empty, so all ranks apply the same messages between the same
steps and schedule identically. The relay is ZMQ PUSH -> PULL: each other rank binds where it
can be reached (ipc on node 0, `tcp://IP:*` on other nodes) and publishes the bound address in
its TP group's rendezvous store, where rank 0 reads it. Only rank 0 sends results; with `--dp` it
also tells the tokenizer's router which requests ended. Before reporting ready, rank 0 tells the
tokenizer the engine's limits (`EngineLimitsMsg`), which the tokenizer checks every request
against: requests arrive here validated, with max_tokens already fitted to the context and pool.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from minisgl.distributed.group import Rendezvous
from minisgl.engine.config import EngineConfig
from minisgl.message.codec import WIRE
from minisgl.message.frontend import EmbeddingMsg, EmbeddingOut, ErrorMsg, LoraAdapterReplyMsg, StatsMsg
from minisgl.message.scheduler import AbortMsg, LoraAdapterMsg, ShutdownMsg, StatsReqMsg, TokenizedMsg
from minisgl.message.tokenizer import DetokFacts, FinishedMsg, TokenOut, TokenOutMsg
from minisgl.scheduler.build import build_scheduler, engine_limits
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.logging import get_logger
from minisgl.utils.process import ReadyReporter
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

if TYPE_CHECKING:
    import torch.distributed as dist

    from minisgl.scheduler.scheduler import Scheduler

logger = get_logger(__name__)

_RELAY_HEADER = b"minisgl-step"


def relay_key(rank: int) -> str:
    """Store key under which `rank` publishes the address it receives relayed bytes on."""
    return f"relay/{rank}"


@dataclass(frozen=True)
class SchedulerAddrs:
    recv: str  # rank 0: requests from the tokenizer; other ranks: where relayed bytes arrive
    detokenizer: str  # rank 0 sends TokenOutMsg here
    frontend: str  # rank 0 answers stats queries and refuses requests here
    router: str | None = None  # rank 0 with --dp: the tokenizer, told which requests ended
    tokenizer: str | None = None  # rank 0: the tokenizer, told the engine's limits once at start-up


class SchedulerLoop:
    """The message handling around `Scheduler.step`, separate from process set-up for tests."""

    def __init__(self, scheduler: Scheduler, addrs: SchedulerAddrs, rank: int) -> None:
        self.scheduler = scheduler
        self.rank = rank
        self.recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv, WIRE)
        self.primary = rank == 0
        self.relay: list[ZmqPushQueue[object]] = []
        self.to_detok: ZmqPushQueue[object] | None = ZmqPushQueue(addrs.detokenizer, WIRE) if self.primary else None
        self.to_frontend: ZmqPushQueue[object] | None = ZmqPushQueue(addrs.frontend, WIRE) if self.primary else None
        router = addrs.router if self.primary else None
        self.to_router: ZmqPushQueue[object] | None = ZmqPushQueue(router, WIRE) if router is not None else None
        tokenizer = addrs.tokenizer if self.primary else None
        self.to_tokenizer: ZmqPushQueue[object] | None = ZmqPushQueue(tokenizer, WIRE) if tokenizer is not None else None
        self.running = True
        # Prompt tokens of every request that produced its first token, and the prefix-cache hits
        # among them (the /metrics hit rate).
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0  # requests received and aborted (per-replica counters of --dp)
        self.aborted = 0

    def announce_limits(self) -> None:
        """Rank 0: tell the tokenizer what it checks requests against (before reporting ready)."""
        if self.to_tokenizer is not None:
            self.to_tokenizer.put(engine_limits(self.scheduler))

    def connect_relay(self, addrs: list[str]) -> None:
        """Rank 0: send every received message on to these ranks (the other ranks' `recv`)."""
        assert self.primary and not self.relay
        self.relay = [ZmqPushQueue[object](addr, WIRE) for addr in addrs]

    def run(self) -> None:
        while self.running:
            self.run_once()

    def run_once(self) -> None:
        outs: list[TokenOut] = []
        new: list[DetokFacts] = []
        refused: list[int] = []
        for msg in self._receive():
            self._handle(msg, outs, new, refused)
        embedded: list[EmbeddingOut] = []
        if self.scheduler.has_work():
            for out in self.scheduler.step():
                if (out.output_tokens == 1 and out.token_ids) or out.embedding is not None:
                    self.prompt_tokens += out.prompt_tokens
                    self.cached_tokens += out.cached_tokens
                if out.embedding is not None:  # an embedding request's vector: straight to the API server
                    embedded.append(EmbeddingOut(out.rid, out.embedding, out.prompt_tokens, out.cached_tokens))
                else:
                    outs.append(out)
        if (outs or new) and self.to_detok is not None:
            self.to_detok.put(TokenOutMsg(outs, new))
        if embedded and self.to_frontend is not None:
            self.to_frontend.put(EmbeddingMsg(embedded))
        if self.to_router is not None:
            ended = refused + [out.rid for out in outs if out.finish_reason is not None] + [e.rid for e in embedded]
            if ended:
                self.to_router.put(FinishedMsg(ended))

    def _receive(self) -> list[object]:
        if not self.primary:
            frames = self.recv.get_raw_multipart()
            return [self.recv.decode(raw) for raw in frames[1:]]
        raws = self.recv.drain_raw()
        if not raws and not self.scheduler.has_work():
            self.scheduler.engine.platform.release_idle_memory()
            raws = [self.recv.get_raw()] + self.recv.drain_raw()  # idle: block for work
        for queue in self.relay:
            queue.put_raw([_RELAY_HEADER, *raws])
        return [self.recv.decode(raw) for raw in raws]

    def _handle(self, msg: object, outs: list[TokenOut], new: list[DetokFacts], refused: list[int]) -> None:
        if isinstance(msg, TokenizedMsg):
            self.requests += 1
            try:  # checked and fitted to the pool by the tokenizer stage
                self.scheduler.add_request(msg.rid, msg.input_ids, msg.sampling, msg.pooling, msg.lora)
            except ValueError as exc:  # wrong task, grammar that does not compile, rid in use, adapter gone: no output follows
                refused.append(msg.rid)
                if self.to_frontend is not None:
                    status = getattr(exc, "status", 400)
                    self.to_frontend.put(ErrorMsg(msg.rid, str(exc), status, getattr(exc, "param", None)))
                return
            if msg.pooling is None:  # an embedding request never reaches the detokenizer
                new.append(msg.facts if msg.facts is not None else DetokFacts(msg.rid))
        elif isinstance(msg, AbortMsg):
            if self.scheduler.abort(msg.rid):
                self.aborted += 1
                if self.primary:
                    logger.info("Aborting request %d", msg.rid)
                # The detokenizer drops its state for the request on this final output.
                outs.append(TokenOut(msg.rid, [], "abort"))
        elif isinstance(msg, StatsReqMsg):
            if self.to_frontend is not None:
                self.to_frontend.put(
                    StatsMsg(**asdict(self.scheduler.stats()), query_id=msg.query_id,
                             prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                             requests=self.requests, aborted=self.aborted, **self.scheduler.spec_counts())  # fmt: skip
                )
        elif isinstance(msg, LoraAdapterMsg):
            self._lora_adapter(msg)
        elif isinstance(msg, ShutdownMsg):
            self.running = False
        else:
            logger.warning("scheduler: ignoring unexpected message %s", type(msg).__name__)

    def _lora_adapter(self, msg: LoraAdapterMsg) -> None:
        """Load or unload an adapter on this rank (every rank applies it at the same point)."""
        reply = LoraAdapterReplyMsg(msg.query_id)
        try:
            if msg.path is None:
                self.scheduler.unload_adapter(msg.name)
            else:
                self.scheduler.load_adapter(msg.name, msg.path)
        except ValueError as exc:
            reply = LoraAdapterReplyMsg(msg.query_id, getattr(exc, "status", 400), str(exc))
        if self.to_frontend is not None:
            self.to_frontend.put(reply)

    def close(self) -> None:
        self.recv.close()
        for queue in self.relay:
            queue.close()
        for q in (self.to_detok, self.to_frontend, self.to_router, self.to_tokenizer):
            if q is not None:
                q.close()


def _join_group(
    engine_config: EngineConfig, rdzv: Rendezvous | None, device_index: int
) -> tuple[EngineConfig, dist.Store | None]:
    """Pick this process's device (the `device_index`-th GPU of its node when on CUDA) and join
    its TP group; returns the per-process config and the group's store (None without TP)."""
    from minisgl.distributed.group import init_tp_group
    from minisgl.platform import init_platform

    platform = init_platform(engine_config.device)
    device = engine_config.device
    if platform.name == "cuda" and not device.startswith("cuda:"):
        device = f"cuda:{device_index}"
        platform = init_platform(device)
    engine_config = replace(engine_config, device=device)
    if engine_config.tp_size == 1:
        return engine_config, None
    if rdzv is None:
        raise ValueError("tensor parallelism needs a rendezvous store")
    store = init_tp_group(rdzv, engine_config.tp_rank, engine_config.tp_size, platform.dist_backend)
    return engine_config, store


def run_scheduler(
    engine_config: EngineConfig,
    sched_config: SchedulerConfig,
    addrs: SchedulerAddrs,
    ready: ReadyReporter,
    rdzv: Rendezvous | None = None,
    device_index: int = 0,
) -> None:
    """Process entry point of one TP rank: join the group, build the scheduler (loads the model),
    wire the relay, report ready, then serve until told to stop."""
    import torch

    engine_config, store = _join_group(engine_config, rdzv, device_index)
    from minisgl.platform import current

    current().prepare_scheduler_process()  # before the model loads
    rank, size = engine_config.tp_rank, engine_config.tp_size
    with torch.inference_mode():
        _, scheduler = build_scheduler(engine_config, sched_config)
        loop = SchedulerLoop(scheduler, addrs, rank)
        try:
            if store is not None and rank > 0:
                store.set(relay_key(rank), loop.recv.endpoint)
            elif store is not None:  # waits (up to the start-up timeout) for every rank to bind
                loop.connect_relay([store.get(relay_key(r)).decode() for r in range(1, size)])
            loop.announce_limits()
            # Everything built so far (modules, tokenizer tables, torch's and the libraries' own
            # objects) lives for the process: out of the collector's reach (as SGLang and vLLM do
            # after start-up), a full collection while serving walks only what requests create.
            gc.collect()
            gc.freeze()
            ready.ready(context_len=scheduler.context_len, total_pages=scheduler.stats().total_pages)
            loop.run()
        finally:
            loop.close()
