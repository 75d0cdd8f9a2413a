"""`POST /v1/embeddings`: one prefill-only request per input, batched by the scheduler with
everything else; each answers with its vector (`EmbeddingOut`, straight from scheduler rank 0).

A text-generation model refuses these requests (400), and an embedding model refuses chat and
completions (400), in the scheduler (`Scheduler.add_request`), so every route answers alike.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl.core import PoolingParams, SamplingParams
from minisgl.message.frontend import EmbeddingOut, ErrorMsg
from minisgl.message.tokenizer import TokenizeMsg
from minisgl.server.embeddings_protocol import EmbeddingRequest, embedding_response
from minisgl.server.openapi import body
from minisgl.server.protocol import parse_request
from minisgl.server.responses import error_response
from minisgl.server.session import Session
from minisgl.server.state import AppState

# An embedding request samples nothing; its one token of room is what the context checks count.
_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


def _error(msg: ErrorMsg) -> JSONResponse:
    # The tokenizer names the prompt `prompt`; this API calls it `input`.
    return error_response(msg.status, msg.message, "input" if msg.param == "prompt" else msg.param)


def add_embedding_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/embeddings", openapi_extra=body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        req: EmbeddingRequest = parse_request(EmbeddingRequest, await request.body())
        prompts = req.prompts()
        pooling = PoolingParams(req.dimensions)
        inbox = state.fm.open(len(prompts), notify_each=False)
        session = Session(state.fm, request, inbox)
        await session.submit([TokenizeMsg(rid, prompt, _POOLING_SAMPLING, True, pooling=pooling)
                              for rid, prompt in zip(inbox.rids, prompts)])  # fmt: skip
        replies = await session.opening(False, _error)
        if isinstance(replies, Response):
            return replies
        by_rid = {r.rid: r for r in replies if isinstance(r, EmbeddingOut)}
        outs = [by_rid[rid] for rid in inbox.rids]
        return JSONResponse(embedding_response(outs, req.model or state.served_model, req.encoding_format))
