"""Typed wire messages, grouped by the process that receives them. No torch here."""

from __future__ import annotations

from minisgl.message.codec import decode, encode, registered_types, wire
from minisgl.message.frontend import (
    DetokenizedMsg,
    ErrorMsg,
    FrontendMsg,
    QueryErrorMsg,
    QueryReply,
    SchedulerStats,
    StatsMsg,
    TextDelta,
    TextDeltaMsg,
    TokenLogprob,
    TokensMsg,
    TopLogprob,
)
from minisgl.message.scheduler import AbortMsg, SchedulerMsg, ShutdownMsg, StatsReqMsg, TokenizedMsg
from minisgl.message.tokenizer import (
    ChatPrompt,
    DetokenizeQueryMsg,
    DetokFacts,
    FinishedMsg,
    Prompt,
    TextPrompt,
    TokenizeMsg,
    TokenizeQueryMsg,
    TokenOut,
    TokenOutMsg,
    TokenPrompt,
)

__all__ = [
    "AbortMsg",
    "ChatPrompt",
    "DetokFacts",
    "DetokenizeQueryMsg",
    "DetokenizedMsg",
    "ErrorMsg",
    "FinishedMsg",
    "FrontendMsg",
    "Prompt",
    "QueryErrorMsg",
    "QueryReply",
    "SchedulerMsg",
    "SchedulerStats",
    "ShutdownMsg",
    "StatsMsg",
    "StatsReqMsg",
    "TextDelta",
    "TextDeltaMsg",
    "TextPrompt",
    "TokenLogprob",
    "TokenOut",
    "TokenOutMsg",
    "TokenPrompt",
    "TokenizeMsg",
    "TokenizeQueryMsg",
    "TokenizedMsg",
    "TokensMsg",
    "TopLogprob",
    "decode",
    "encode",
    "registered_types",
    "wire",
]
