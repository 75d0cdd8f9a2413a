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


def build_scheduler(engine_config: EngineConfig, sched_config: SchedulerConfig) -> tuple[Engine, Scheduler]:
    """The engine (loads the model) and the scheduler handed it."""
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.scheduler import Scheduler

    engine = Engine(replace(engine_config, max_running_requests=sched_config.max_running_requests))
    return engine, Scheduler(engine, sched_config)


def engine_limits(scheduler: Scheduler) -> EngineLimitsMsg:
    """What the request entry checks against: the served context, the vocabulary, and the
    tokens the KV pool holds (a request's worst case must fit in it, or it could never run)."""
    return EngineLimitsMsg(scheduler.context_len, scheduler.vocab_size, scheduler.stats().total_pages * scheduler.page_size)
