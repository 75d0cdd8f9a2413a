"""`POST /tokenize`, `POST /detokenize` (vLLM's shapes) and `GET /metrics`.

Tokenizing needs the tokenizer, which lives in the tokenizer process: these routes ask it with a
query message and await the answer, so the API server never loads a tokenizer itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import field_validator, model_validator

from minisgl.message.frontend import DetokenizedMsg, QueryErrorMsg, QueryReply, TokensMsg
from minisgl.message.tokenizer import ChatPrompt, DetokenizeQueryMsg, TextPrompt, TokenizeQueryMsg
from minisgl.server.chat_protocol import check_message, check_tool
from minisgl.server.metrics import CONTENT_TYPE
from minisgl.server.openapi import body
from minisgl.server.protocol import RequestError, _Strict, parse_request
from minisgl.server.responses import error_response
from minisgl.server.state import AppState
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)


class TokenizeRequest(_Strict):
    """`{"prompt": str}` or `{"messages": [...]}` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v is not None:
            if not v:
                raise ValueError("messages must not be empty")
            return [check_message(i, m) for i, m in enumerate(v)]
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            check_tool(i, tool)
        return v

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of 'prompt' and 'messages'", "prompt")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise RequestError("'tools' and 'chat_template_kwargs' only apply to 'messages'", "tools")
        return self

    def query(self, query_id: int) -> TokenizeQueryMsg:
        if self.messages is not None:
            kwargs = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
            prompt = ChatPrompt(self.messages, list(self.tools or []), kwargs)
            return TokenizeQueryMsg(query_id, prompt, bool(self.add_special_tokens))
        assert self.prompt is not None
        special = True if self.add_special_tokens is None else self.add_special_tokens
        return TokenizeQueryMsg(query_id, TextPrompt(self.prompt), special)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, v: list[int]) -> list[int]:
        bad = next((t for t in v if not 0 <= t < 2**63), None)  # the vocabulary is checked by the tokenizer
        if bad is not None:
            raise ValueError(f"token id {bad} is out of range")
        return v


def _answer(reply: QueryReply, ok: type) -> Any:
    if isinstance(reply, QueryErrorMsg):
        raise RequestError(reply.message, reply.param)
    assert isinstance(reply, ok)
    return reply


def add_utility_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/tokenize", openapi_extra=body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = parse_request(TokenizeRequest, await request.body())
        try:
            reply = await state.fm.query(req.query, to_tokenizer=True)
        except asyncio.TimeoutError:
            return error_response(503, "the tokenizer did not answer in time")
        tokens = _answer(reply, TokensMsg).token_ids
        return JSONResponse({"count": len(tokens), "max_model_len": state.context_len, "tokens": tokens})

    @app.post("/detokenize", openapi_extra=body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await request.body())
        try:
            reply = await state.fm.query(lambda q: DetokenizeQueryMsg(q, req.tokens), to_tokenizer=True)
        except asyncio.TimeoutError:
            return error_response(503, "the tokenizer did not answer in time")
        return JSONResponse({"prompt": _answer(reply, DetokenizedMsg).text})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await state.fm.stats(timeout=2.0)
        except asyncio.TimeoutError:  # still serve the request counters
            logger.warning("/metrics: the scheduler did not answer the stats query in time")
            stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)
