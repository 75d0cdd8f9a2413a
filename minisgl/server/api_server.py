"""The HTTP front end: OpenAI-compatible routes, a native /generate, health and stats
(tokenize, detokenize and metrics are in utility_routes.py; API key and CORS in access.py).

Handlers validate the body (protocol.py, chat_protocol.py), open an inbox for their rids, send
`TokenizeMsg`s and then either collect the full answer or stream SSE chunks (session.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.message.tokenizer import Prompt, TextPrompt, TokenizeMsg, TokenPrompt
from minisgl.server.access import install_access
from minisgl.server.anthropic_api import add_anthropic_routes
from minisgl.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from minisgl.server.chat_protocol import ChatCompletionRequest
from minisgl.server.choice import ChoiceOptions
from minisgl.server.embeddings_api import add_embedding_routes
from minisgl.server.embeddings_protocol import EmbeddingRequest
from minisgl.server.frontend import FrontendManager
from minisgl.server.lora_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, add_lora_routes, model_cards, with_adapter
from minisgl.server.openapi import body, install_docs
from minisgl.server.page import add_page_routes
from minisgl.server.protocol import CompletionRequest, GenerateRequest, RequestError, parse_request
from minisgl.server.request_msgs import chat_msgs, chat_options, completion_msgs
from minisgl.server.responses import ResponseBuilder, error_response
from minisgl.server.responses_api import add_responses_routes
from minisgl.server.responses_protocol import ResponsesRequest
from minisgl.server.session import Session, respond, respond_native
from minisgl.server.state import AppState
from minisgl.server.utility_routes import DetokenizeRequest, TokenizeRequest, add_utility_routes
from minisgl.utils.logging import get_logger

__all__ = ["AppState", "create_app"]

logger = get_logger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DESCRIPTION = ("OpenAI-compatible API (chat and text completions, models) and minisgl's own routes "
                "(generate, tokenize, detokenize, health, metrics, stats). Errors use OpenAI's error object.")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minisgl")
    except PackageNotFoundError:
        return "0"


def create_app(state: AppState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.frontend = FrontendManager(state.addrs, observer=state.metrics)
        state.frontend.start()
        yield
        await state.frontend.close()

    app = FastAPI(title="minisgl", version=_version(), description=_DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)  # served by install_docs (openapi.py)
    install_access(app, state.api_key, state.cors_origins, state.max_body_bytes)
    app.state.metrics = state.metrics  # admission.guard_app exports its counters through it

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"Invalid request: {exc.errors()[0].get('msg', exc)}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(404, f"Unknown route: {request.method} {request.url.path}")
        if exc.status_code == 405:
            return error_response(405, f"Method {request.method} is not allowed on {request.url.path}")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}")

    @app.post("/v1/chat/completions", openapi_extra=body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        sampling, explicit = req.sampling(state.context_len)
        adapter = state.lora.adapter_for(req.model, state.served_model)  # 404 for an unknown one
        inbox = state.fm.open(req.n, notify_each=req.stream)
        msgs = with_adapter(chat_msgs(req, inbox.rids, sampling, explicit), adapter)
        session = Session(state.fm, request, inbox)
        await session.submit(msgs)
        builder = ResponseBuilder("chat", req.model or state.served_model, inbox.rids, True, chat_options(req))
        return await respond(session, builder, req.stream, req.include_usage)

    @app.post("/v1/completions", openapi_extra=body(CompletionRequest))
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        sampling, explicit = req.sampling(COMPLETIONS_DEFAULT_MAX_TOKENS)
        explicit = True  # the default of 16 is a real limit, not "the rest of the context"
        raw = req.prompts()
        prompts: list[Prompt] = [TextPrompt(p) if isinstance(p, str) else TokenPrompt(p) for p in raw]
        adapter = state.lora.adapter_for(req.model, state.served_model)
        inbox = state.fm.open(len(prompts) * req.n, notify_each=req.stream)
        msgs = with_adapter(completion_msgs(req, prompts, inbox.rids, sampling, explicit), adapter)
        session = Session(state.fm, request, inbox)
        await session.submit(msgs)
        options = ChoiceOptions(logprobs=req.logprobs is not None, echo=req.echo)
        echo_texts = [p if isinstance(p, str) else None for p in raw for _ in range(req.n)]
        builder = ResponseBuilder("completion", req.model or state.served_model, inbox.rids,
                                  len(prompts) == 1, options, echo_texts, n=req.n)  # fmt: skip
        return await respond(session, builder, req.stream, req.include_usage)

    @app.post("/generate", openapi_extra=body(GenerateRequest))
    async def generate(request: Request) -> Response:
        req: GenerateRequest = parse_request(GenerateRequest, await request.body())
        prompt: Prompt = TextPrompt(req.text) if req.text is not None else TokenPrompt(req.input_ids or [])
        sampling = req.sampling()  # may refuse the request: before any reply state exists
        inbox = state.fm.open(1, notify_each=req.stream)
        session = Session(state.fm, request, inbox)
        await session.submit([TokenizeMsg(inbox.rids[0], prompt, sampling, True, req.stop_list())])
        return await respond_native(session, req.stream)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state), *model_cards(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id == state.served_model:
            return _model_card(state)
        card = next((c for c in model_cards(state) if c["id"] == model_id), None)
        return card if card is not None else error_response(404, f"The model '{model_id}' does not exist", "model")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, details = state.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", **details}, status_code=200 if ok else 503)

    @app.get("/v1/internal/stats")
    async def stats() -> Response:
        try:
            stats = await state.fm.stats()
        except asyncio.TimeoutError:
            return error_response(503, "the scheduler did not answer the stats query in time")
        s = stats.total  # summed over --dp replicas; each one under "replicas"
        return JSONResponse({
            "total_pages": s.total_pages, "free_pages": s.free_pages, "cached_pages": s.cached_pages,
            "evictable_pages": s.evictable_pages, "running": s.running, "waiting": s.waiting,
            "live_requests": state.fm.live_requests,
            "replicas": [{"replica": i, "requests": r.requests, "aborted": r.aborted, "running": r.running,
                          "waiting": r.waiting, "total_pages": r.total_pages, "free_pages": r.free_pages}
                         for i, r in enumerate(stats.replicas)],
        })  # fmt: skip

    add_utility_routes(app, state)
    add_anthropic_routes(app, state)
    add_embedding_routes(app, state)
    add_responses_routes(app, state)
    add_lora_routes(app, state)  # /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_api.py)
    add_page_routes(app)  # GET /: the chat page (page.py)
    install_docs(app, [ChatCompletionRequest, CompletionRequest, GenerateRequest, TokenizeRequest, DetokenizeRequest,
                       MessagesRequest, CountTokensRequest, EmbeddingRequest, ResponsesRequest,
                       LoadLoraAdapterRequest, UnloadLoraAdapterRequest])
    return app


def _model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.served_model, "object": "model", "created": state.started or int(time.time()),
            "owned_by": "minisgl", "max_model_len": state.context_len}  # fmt: skip
