"""Build the engine and the scheduler handed it: shared by the scheduler process and the offline
`LLM`. Nothing here imports zmq (the offline API runs without sockets)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from minisgl.engine.config import EngineConfig
from minisgl.message.tokenizer import EngineLimitsMsg
from minisgl.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.scheduler import Scheduler
    from minisgl.scheduler.speculative_draft import DraftProposer


def build_scheduler(engine_config: EngineConfig, sched_config: SchedulerConfig) -> tuple[Engine, Scheduler]:
    """The engine (loads the model) and the scheduler handed it."""
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.scheduler import Scheduler

    # A speculating request's verify row is 1 + K decode entries (the graphs are captured for them).
    k = sched_config.num_speculative_tokens if sched_config.speculative_algorithm is not None else 0
    engine = Engine(replace(engine_config, max_running_requests=sched_config.max_running_requests,
                            decode_entries_per_request=1 + k))  # fmt: skip
    proposer = None
    if sched_config.speculative_algorithm == "draft":
        proposer = _draft_proposer(engine, sched_config)
    return engine, Scheduler(engine, sched_config, proposer)


def _draft_proposer(target: Engine, sched_config: SchedulerConfig) -> DraftProposer:
    """Speculative decoding's draft model: a second engine like the target's (device, dtype, page
    size, rows) with as many KV pages (its own pool), proposing greedily."""
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.speculative_draft import DraftProposer

    config = target.config
    if config.tp_size > 1:
        raise ValueError("speculative decoding with a draft model runs at one rank (--tp 1)")
    assert sched_config.speculative_draft_model is not None
    draft = Engine(replace(config, model=sched_config.speculative_draft_model, weights="auto",
                           num_pages=target.pool.num_pages, max_model_len=target.context_len,
                           decode_entries_per_request=1))  # fmt: skip
    return DraftProposer(draft, target.model_config.vocab_size, target.config.max_running_requests)


def engine_limits(scheduler: Scheduler) -> EngineLimitsMsg:
    """What the request entry checks against: the served context, the vocabulary, and the
    tokens the KV pool holds (a request's worst case must fit in it, or it could never run)."""
    return EngineLimitsMsg(scheduler.context_len, scheduler.vocab_size, scheduler.stats().total_pages * scheduler.page_size)
