"""Typed wire messages, grouped by the process that receives them. No torch here."""

from __future__ import annotations

from minisgl.message.codec import decode, encode, registered_types, wire
from minisgl.message.frontend import ErrorMsg, FrontendMsg, StatsMsg, TextDelta, TextDeltaMsg
from minisgl.message.scheduler import AbortMsg, SchedulerMsg, ShutdownMsg, StatsReqMsg, TokenizedMsg
from minisgl.message.tokenizer import (
    ChatPrompt,
    DetokRegisterMsg,
    Prompt,
    TextPrompt,
    TokenizeMsg,
    TokenOut,
    TokenOutMsg,
    TokenPrompt,
)

__all__ = [
    "AbortMsg",
    "ChatPrompt",
    "DetokRegisterMsg",
    "ErrorMsg",
    "FrontendMsg",
    "Prompt",
    "SchedulerMsg",
    "ShutdownMsg",
    "StatsMsg",
    "StatsReqMsg",
    "TextDelta",
    "TextDeltaMsg",
    "TextPrompt",
    "TokenOut",
    "TokenOutMsg",
    "TokenPrompt",
    "TokenizeMsg",
    "TokenizedMsg",
    "decode",
    "encode",
    "registered_types",
    "wire",
]
