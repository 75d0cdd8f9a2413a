"""Anthropic Messages request bodies, validated, and their translation into the chat request.

A Messages body becomes the same `ChatCompletionRequest` the OpenAI route builds (chat_protocol.py):
`system` leads as a system message, `tool_use` blocks become an assistant's `tool_calls`,
`tool_result` blocks become `tool` messages, Anthropic tools become function tools and
`tool_choice` auto / any / tool / none becomes auto / required / named / none. Sampling,
tool prompting and tool-call parsing are then the chat path's own.

Errors use Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import field_validator

from minisgl.server.chat_protocol import ChatCompletionRequest
from minisgl.server.protocol import RequestError, _Strict, parse_request

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


def _text_of(where: str, content: Any) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    parts: list[str] = []
    for j, block in enumerate(content):
        _check_block(f"{where}[{j}]", block, "text")
        parts.append(block["text"])
    return "".join(parts)


_BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                 "thinking": {"type", "thinking", "signature", "cache_control"},
                 "redacted_thinking": {"type", "data", "cache_control"},
                 "tool_use": {"type", "id", "name", "input", "cache_control"},
                 "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}  # fmt: skip


def _check_block(where: str, block: Any, *allowed: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        shown = kind if kind is not None else type(block).__name__
        raise ValueError(f"{where}: content block type {shown!r} is not supported here; "
                         f"expected {' or '.join(repr(a) for a in allowed)}")  # fmt: skip
    extra = set(block) - _BLOCK_FIELDS[kind] - ({"citations"} if block.get("citations") is None else set())
    if extra:
        raise ValueError(f"{where}: unsupported field '{sorted(extra)[0]}'")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise ValueError(f"{where}: a text block is {{'type': 'text', 'text': <string>}}")
    if kind == "tool_use":
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise ValueError(f"{where}: a tool_use block needs 'id' and 'name' (strings)")
        if not isinstance(block.get("input"), dict):
            raise ValueError(f"{where}.input must be an object")
    if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
        raise ValueError(f"{where}: a tool_result block needs 'tool_use_id' (string)")
    return kind


def _chat_messages(index: int, message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages (tool results become `tool` messages)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or set(message) - {"role", "content"} or "content" not in message:
        raise ValueError(f"{where}: a message is {{'role': 'user' | 'assistant', 'content': ...}}")
    role, content = message.get("role"), message["content"]
    if role not in ("user", "assistant"):
        raise ValueError(f"{where}: unknown role {role!r}; expected 'user' or 'assistant'")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content blocks")
    # Past thinking blocks are accepted and dropped: the templates re-render no past thinking.
    kinds = ("text", "tool_use", "thinking", "redacted_thinking") if role == "assistant" else ("text", "tool_result")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = _check_block(f"{where}.content[{j}]", block, *kinds)
        if kind in ("thinking", "redacted_thinking"):
            continue
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            arguments = json.dumps(block["input"], ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        else:
            result = _text_of(f"{where}.content[{j}].content", block.get("content", ""))
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            reply["tool_calls"] = calls
        return [reply]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise ValueError(f"{where}: only custom tools ({{'name', 'description', 'input_schema'}}) are supported")
    extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
    if extra:
        raise ValueError(f"{where}: unsupported field '{sorted(extra)[0]}'")
    if not isinstance(tool.get("input_schema"), dict):
        raise ValueError(f"{where}.input_schema is required (a JSON schema object)")
    function: dict[str, Any] = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


class _MessagesBase(_Strict):
    """What both /v1/messages and /v1/messages/count_tokens take: the conversation and tools."""

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Any]) -> list[Any]:
        if not v:
            raise ValueError("messages must not be empty")
        for i, message in enumerate(v):
            _chat_messages(i, message)
        return v

    @field_validator("system")
    @classmethod
    def _system(cls, v: str | list[Any] | None) -> str | list[Any] | None:
        if v is not None:
            _text_of("system", v)
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        for i, tool in enumerate(v or []):
            _check_tool(i, tool)
        return v

    @field_validator("thinking")
    @classmethod
    def _thinking(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = v.get("type") if v is not None else None
        if v is not None and (kind not in ("enabled", "disabled") or set(v) - {"type", "budget_tokens"}):
            raise ValueError("thinking is {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
        return v

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.get("type") == "enabled"

    def chat_body(self) -> dict[str, Any]:
        """The equivalent OpenAI chat completions body."""
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": _text_of("system", self.system)})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(i, message)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [_check_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_tool_choice(self.tool_choice, bool(self.tools)))
        if self.thinking is not None and not self.thinking_enabled:  # Qwen3-style templates skip the thinking
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return body


def _tool_choice(choice: dict[str, Any], has_tools: bool) -> dict[str, Any]:
    kind = choice.get("type")
    allowed = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
               "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}  # fmt: skip
    if kind not in allowed or set(choice) - allowed[kind]:
        raise RequestError("tool_choice is {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                           "tool_choice")  # fmt: skip
    if kind in ("any", "tool") and not has_tools:
        raise RequestError(f"tool_choice '{kind}' needs 'tools'", "tool_choice")
    out: dict[str, Any] = {}
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif has_tools:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") and has_tools:
        out["parallel_tool_calls"] = False
    return out


class MessagesRequest(_MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Harmless: accepted, no effect on the output.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        # Anthropic's own range, narrower than SamplingParams' (which checks the rest, through `to_chat`).
        if v is not None and not 0 <= v <= 1:
            raise ValueError("temperature must be in [0, 1]")
        return v

    def to_chat(self) -> ChatCompletionRequest:
        body = self.chat_body()
        body.update(max_tokens=self.max_tokens, stream=self.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        return parse_chat(body)


class CountTokensRequest(_MessagesBase):
    def to_chat(self) -> ChatCompletionRequest:
        return parse_chat(self.chat_body())


def parse_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    """Validate the translated body with the chat route's own rules."""
    chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    return chat
