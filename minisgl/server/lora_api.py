"""LoRA adapters over HTTP, vLLM-shaped: `POST /v1/load_lora_adapter` {lora_name, lora_path},
`POST /v1/unload_lora_adapter` {lora_name}; a request's `model` picks an adapter, and
`/v1/models` lists them beside the base model (with `root` and `parent`).

The API server keeps the names it may route to (`LoraRegistry`, lora_registry.py). A load or unload goes to every
replica through the tokenizer, on the same stream as the requests, so the scheduler sees every
request sent before it first; each replica's rank 0 answers. An unloaded name is refused at once
(404); the scheduler keeps its weights until the requests already using it end.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from minisgl.message.frontend import LoraAdapterReplyMsg
from minisgl.message.scheduler import LoraAdapterMsg
from minisgl.server.openapi import body
from minisgl.server.lora_registry import LoraRegistry
from minisgl.server.protocol import RequestError, parse_request
from minisgl.server.responses import error_response

if TYPE_CHECKING:
    from minisgl.message.tokenizer import TokenizeMsg
    from minisgl.server.state import AppState

LOAD_TIMEOUT = 120.0  # seconds a replica may take to read an adapter


class _AdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1, description="the adapter's name: what a request's `model` names")


class LoadLoraAdapterRequest(_AdapterBody):
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory on the server "
                           "(adapter_config.json + adapter_model.safetensors)")


class UnloadLoraAdapterRequest(_AdapterBody):
    lora_int_id: int | None = Field(None, description="accepted for vLLM's clients; the name alone "
                                    "identifies an adapter here")


def with_adapter(msgs: list[TokenizeMsg], adapter: str | None) -> list[TokenizeMsg]:
    for msg in msgs:
        msg.lora = adapter
    return msgs


def model_cards(state: AppState) -> list[dict[str, Any]]:
    """The adapters' `/v1/models` entries (after the base model's)."""
    created = state.started or int(time.time())
    return [{"id": name, "object": "model", "created": created, "owned_by": "minisgl", "root": path,
             "parent": state.served_model, "max_model_len": state.context_len}
            for name, path in state.lora.adapters.items()]  # fmt: skip


async def _on_every_replica(state: AppState, name: str, path: str | None) -> LoraAdapterReplyMsg:
    """Send the load / unload to every replica; the first refusal, else a success."""
    fm = state.fm

    async def one(replica: int) -> LoraAdapterReplyMsg:
        reply = await fm.query(lambda q: LoraAdapterMsg(q, replica, name, path), to_tokenizer=True,
                               timeout=LOAD_TIMEOUT)  # fmt: skip
        assert isinstance(reply, LoraAdapterReplyMsg)
        return reply

    replies = await asyncio.gather(*(one(i) for i in range(len(fm.to_schedulers))))
    return next((r for r in replies if r.status != 200), replies[0])


def add_lora_routes(app: FastAPI, state: AppState) -> None:
    registry = state.lora

    def refuse_off() -> None:
        if not registry.enabled:
            raise RequestError("LoRA is not enabled: start the server with --enable-lora or --lora-modules")

    @app.post("/v1/load_lora_adapter", openapi_extra=body(LoadLoraAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        req: LoadLoraAdapterRequest = parse_request(LoadLoraAdapterRequest, await request.body())  # type: ignore[arg-type]
        refuse_off()
        name = req.lora_name
        if name in registry.adapters or name == state.served_model:
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name in registry.busy:
            raise RequestError(f"The lora adapter '{name}' is being loaded or unloaded.", "lora_name")
        registry.busy.add(name)
        try:
            try:
                reply = await _on_every_replica(state, name, req.lora_path)
            except asyncio.TimeoutError:
                return error_response(503, f"loading the lora adapter '{name}' did not finish in time")
            if reply.status != 200:
                if len(state.fm.to_schedulers) > 1:  # replicas that loaded it let it go again
                    await _on_every_replica(state, name, None)
                return error_response(reply.status, reply.message, "lora_path" if reply.status == 404 else None)
            registry.adapters[name] = req.lora_path
        finally:
            registry.busy.discard(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body(UnloadLoraAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        req: UnloadLoraAdapterRequest = parse_request(UnloadLoraAdapterRequest, await request.body())  # type: ignore[arg-type]
        refuse_off()
        name = req.lora_name
        if name not in registry.adapters or name in registry.busy:
            return error_response(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        # Refused to new requests from now on; those already sent finish on it (the scheduler's count).
        del registry.adapters[name]
        registry.busy.add(name)
        try:
            try:
                reply = await _on_every_replica(state, name, None)
            except asyncio.TimeoutError:
                return error_response(503, f"unloading the lora adapter '{name}' did not finish in time")
        finally:
            registry.busy.discard(name)
        if reply.status != 200:
            return error_response(reply.status, reply.message, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
