"""What the API server's routes share: addresses, the served model, access settings, metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl.server.access import MAX_BODY_BYTES
from minisgl.server.frontend import FrontendAddrs, FrontendManager
from minisgl.server.lora_registry import LoraRegistry
from minisgl.server.metrics import ServerMetrics


@dataclass
class AppState:
    addrs: FrontendAddrs
    served_model: str
    context_len: int
    health: Callable[[], tuple[bool, dict[str, Any]]]  # (all children alive, details)
    started: int = 0
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies get 413 (access.BodyLimitMiddleware)
    frontend: FrontendManager | None = None
    reasoning_parser: str | None = None  # --reasoning-parser (the split itself is the detokenizer's)
    max_stored_responses: int = 1000  # /v1/responses store (responses_api.py)
    lora: LoraRegistry = field(default_factory=LoraRegistry)  # adapters a request's `model` may name
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.served_model)

    @property
    def fm(self) -> FrontendManager:
        assert self.frontend is not None, "the frontend starts with the app"
        return self.frontend
