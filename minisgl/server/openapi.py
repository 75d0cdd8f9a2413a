"""`GET /openapi.json` (OpenAPI 3.1) and `GET /docs` (Swagger UI, served from this machine).

The generation and utility routes read their raw body and validate it themselves (protocol.py,
chat_protocol.py), so that every bad body gets an OpenAI-shaped 400 naming the field. FastAPI
therefore cannot see their body models; each route declares its model with `body(Model)`
(`openapi_extra`), and `install_docs` puts the models' JSON schemas (pydantic's, with a
description for each field) into `components.schemas`. The schema documents; it does not
validate: a body it allows may still be refused with a 400 (ranges checked against the model's
context, token ids against the vocabulary, ...).

Swagger UI's script and style sheet come from the `swagger-ui-bundle-v2` package and are served
under `/docs/assets/`: the page needs no network. With `--api-key`, `/openapi.json`, `/docs` and
its assets need the key like every route but `/health` (access.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import BaseModel

from minisgl.server.responses import error_response

OPENAPI_URL = "/openapi.json"
DOCS_URL = "/docs"
_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}

# What each field does, by name (the same name means the same thing in every body).
FIELD_DOCS: dict[str, str] = {
    "model": "Model name; any value is accepted (the server serves one model, see GET /v1/models).",
    "messages": "The conversation: objects with 'role' (system, user, assistant, developer, tool) and "
                "'content' (a string or a list of text parts); assistant turns may carry 'tool_calls'.",
    "prompt": "A string, a list of strings, a list of token ids, or a list of token-id lists.",
    "stream": "Send the answer as server-sent events ('data: {...}' chunks, then 'data: [DONE]').",
    "stream_options": "With stream=true: {'include_usage': true} adds a final chunk with token usage.",
    "n": "Number of choices to generate for each prompt (1-64).",
    "temperature": "Sampling temperature >= 0; 0 is greedy.",
    "top_p": "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].",
    "top_k": "Keep the k most likely tokens; -1 or 0 disables it.",
    "min_p": "Drop tokens less likely than min_p times the most likely one, in [0, 1].",
    "stop": "Up to 16 strings; generation ends before the first one produced (see include_stop_str_in_output).",
    "stop_token_ids": "Token ids that end generation when sampled.",
    "include_stop_str_in_output": "Keep the matched stop string at the end of the text.",
    "ignore_eos": "Keep generating past the end-of-sequence token (until max_tokens).",
    "seed": "Seed of the sampler, for reproducible sampling (0 to 2^63-1).",
    "max_tokens": "Most tokens to generate; default: the rest of the context (chat) or 16 (completions).",
    "max_completion_tokens": "OpenAI's newer name for max_tokens (chat).",
    "min_tokens": "Generate at least this many tokens before a stop token or EOS may end the answer.",
    "frequency_penalty": "Penalty in [-2, 2] growing with how often a token already appeared.",
    "presence_penalty": "Penalty in [-2, 2] for any token that already appeared.",
    "repetition_penalty": "Multiplicative penalty in (0, 10] on tokens of the prompt and output (1: off).",
    "logit_bias": "Map of token id (as a string) to a bias in [-100, 100] added to its logit.",
    "response_format": "{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'name', 'schema'}}: "
                       "constrain the output to JSON, optionally matching a JSON schema.",
    "regex": "Constrain the output to match this regular expression.",
    "logprobs": "Chat: return the log-probability of each output token. Completions: how many top "
                "alternatives to return per token (0-20).",
    "top_logprobs": "With logprobs=true: how many top alternatives to return per token (0-20).",
    "echo": "Return the prompt before the completion (with its logprobs when asked).",
    "tools": "Functions the model may call: [{'type': 'function', 'function': {'name', 'description', "
             "'parameters'}}].",
    "tool_choice": "'none', 'auto', 'required', or {'type': 'function', 'function': {'name': ...}}.",
    "parallel_tool_calls": "Allow more than one tool call in one answer (default true).",
    "chat_template_kwargs": "Extra variables for the model's chat template (e.g. enable_thinking).",
    "best_of": "Only best_of = n is supported.",
    "suffix": "Not supported (must be empty).",
    "user": "Accepted and ignored.",
    "metadata": "Accepted and ignored.",
    "store": "Accepted and ignored.",
    "service_tier": "Accepted and ignored.",
    "text": "The prompt text (give either text or input_ids).",
    "input_ids": "The prompt as token ids (give either text or input_ids).",
    "sampling_params": "Sampling controls of the native API (max_new_tokens, temperature, stop, ...).",
    "max_new_tokens": "Most tokens to generate.",
    "min_new_tokens": "Generate at least this many tokens.",
    "json_schema": "Constrain the output to JSON matching this schema (a JSON string).",
    "add_special_tokens": "Add the tokenizer's special tokens (default: true for a prompt, false for messages).",
    "add_generation_prompt": "End the templated messages with the assistant's turn header.",
    "tokens": "Token ids to turn back into text.",
    "include_usage": "Add a final chunk with token usage.",
}


def body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model` (the route validates it itself)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        "responses": {"400": {"description": "Invalid request (OpenAI error object naming the field)"}},
        "x-body-model": model.__name__,
    }


def _describe(schema: dict[str, Any]) -> None:
    for name, prop in schema.get("properties", {}).items():
        if name in FIELD_DOCS and "description" not in prop:
            prop["description"] = FIELD_DOCS[name]


def build_openapi(app: FastAPI, models: list[type[BaseModel]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in model_schema.pop("$defs", {}).items():
            _describe(sub)
            components[name] = sub
        _describe(model_schema)
        components[model.__name__] = model_schema
    for path in schema.get("paths", {}).values():
        for op in path.values():
            name = op.pop("x-body-model", None)
            assert name is None or name in components, f"body model {name} is not documented"
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}, {}]  # the key is needed only when the server has one
    return schema


def install_docs(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve the OpenAPI document and Swagger UI (create the app with openapi_url=None)."""
    cached: dict[str, Any] = {}

    @app.get(OPENAPI_URL, include_in_schema=False)
    async def openapi() -> Response:
        if not cached:
            cached.update(build_openapi(app, models))
        return JSONResponse(cached)

    @app.get(DOCS_URL, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{app.title} - API",
                                   swagger_js_url=f"{DOCS_URL}/assets/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_URL}/assets/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_URL}/assets/favicon-32x32.png")  # fmt: skip

    @app.get(DOCS_URL + "/assets/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        folder = _assets_dir()
        if name not in _ASSETS or folder is None:
            return error_response(404, f"Unknown route: GET {DOCS_URL}/assets/{name}")
        return FileResponse(folder / name, media_type=_ASSETS[name])


def _assets_dir() -> Path | None:
    try:
        import swagger_ui_bundle
    except ImportError:  # the dependency is missing: /docs still serves its page, without script
        return None
    return Path(swagger_ui_bundle.swagger_ui_path)
