"""OpenAI Responses request bodies, validated, their translation into the chat request, and the
bounded store behind `previous_response_id` and `GET /v1/responses/{id}`.

A Responses body becomes the same `ChatCompletionRequest` the chat route builds (chat_protocol.py):
`instructions` lead as a system message, a string `input` is one user message, `message` items are
chat messages, consecutive `function_call` items become one assistant turn's `tool_calls` and a
`function_call_output` item a `tool` message; `reasoning` items given back are dropped (the
templates re-render no past thinking). Function tools become chat tools, `tool_choice` maps one
to one, `text.format` becomes `response_format`, `max_output_tokens` is `max_tokens`. With
`previous_response_id`, the stored conversation of that response (its input and output, without
its instructions, as OpenAI specifies) comes before the new input.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from minisgl.server.chat_protocol import ChatCompletionRequest
from minisgl.server.protocol import RequestError, _Strict, parse_request

_MESSAGE_FIELDS = {"type", "role", "content", "id", "status"}
_CALL_FIELDS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_FIELDS = {"type", "call_id", "output", "id", "status"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(where: str, content: Any) -> str:
    """A message's content: a string or a list of text parts, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of input_text parts", where)
    parts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: content part type {kind!r} is not supported, only "
                               "{'type': 'input_text', 'text': ...}", where)  # fmt: skip
        parts.append(part["text"])
    return "".join(parts)


def _check_fields(where: str, item: dict[str, Any], allowed: set[str]) -> None:
    extra = set(item) - allowed
    if extra:
        raise RequestError(f"{where}: unsupported field '{sorted(extra)[0]}'", where)


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Responses input -> chat messages (tool calls and their outputs included)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: an input item is an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _check_fields(where, item, _MESSAGE_FIELDS)
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}: role must be 'user', 'assistant', 'system' or 'developer'", "input")
            text = _text(f"{where}.content", item.get("content"))
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            _check_fields(where, item, _CALL_FIELDS)
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"{where}: a function_call item needs 'call_id', 'name' and 'arguments' "
                                   "(strings)", "input")  # fmt: skip
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_fields(where, item, _OUTPUT_FIELDS)
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: a function_call_output item needs 'call_id' (string)", "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(f"{where}.output", output)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # past thinking: not shown to the model again
        else:
            raise RequestError(f"{where}: input item type {kind!r} is not supported; expected 'message', "
                               "'function_call', 'function_call_output' or 'reasoning'", "input")  # fmt: skip
    return out


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise RequestError(f"{where}: tool type {kind!r} is not supported, only 'function'", "tools")
    _check_fields(where, tool, {"type", "name", "description", "parameters", "strict"})
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none | auto | required: the chat request checks it
    if set(choice) != {"type", "name"} or choice.get("type") != "function":
        raise RequestError("tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                           "tool_choice")  # fmt: skip
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    _check_fields("text", text, {"format", "verbosity"})
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _check_fields("text.format", fmt, {"type"})
        return {"type": kind}
    if kind != "json_schema":
        raise RequestError("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")
    _check_fields("text.format", fmt, {"type", "name", "schema", "strict", "description"})
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _doc(text: str) -> Any:
    return Field(default=None, description=text)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Any] = Field(description="A string (one user message) or a list of items: messages "
                                   "(role, content), function_call and function_call_output items.")  # fmt: skip
    instructions: str | None = _doc("A system message before the input (not carried by previous_response_id).")
    tools: list[Any] | None = _doc("Function tools: {'type': 'function', 'name', 'description', 'parameters'}.")
    tool_choice: str | dict[str, Any] | None = _doc("'none', 'auto', 'required' or {'type': 'function', 'name'}.")
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = _doc("{'format': {'type': 'text' | 'json_object' | 'json_schema', ...}}: "
                                       "structured output.")  # fmt: skip
    max_output_tokens: int | None = _doc("The most tokens the reply may have (thinking included).")
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = Field(default=True, description="Keep the response for GET and previous_response_id.")
    previous_response_id: str | None = _doc("A stored response whose conversation comes before this input.")
    reasoning: dict[str, Any] | None = _doc("{'effort': ...}: handed to the chat template as reasoning_effort.")
    # Harmless: accepted, no effect on the output.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = _doc("Accepted; a prompt too long for the context is a 400.")
    include: list[str] | None = _doc("Accepted, no effect.")
    background: Literal[False] | None = _doc("Only false: background responses are not supported.")

    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list[Any]) -> str | list[Any]:
        if not v:
            raise ValueError("input must not be empty")
        input_messages(v)  # raises RequestError naming the item
        return v

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_output_tokens must be at least 1")
        return v

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            if set(v) - {"effort", "summary", "generate_summary"}:
                raise ValueError(f"unsupported field '{sorted(set(v) - {'effort', 'summary', 'generate_summary'})[0]}'")
            if v.get("effort") not in (None, "none", "minimal", "low", "medium", "high"):
                raise ValueError("reasoning.effort must be 'minimal', 'low', 'medium' or 'high'")
        return v

    @model_validator(mode="after")
    def _translatable(self) -> ResponsesRequest:
        for i, tool in enumerate(self.tools or []):
            _chat_tool(i, tool)
        if self.tool_choice is not None:
            _tool_choice(self.tool_choice)
        _response_format(self.text)
        return self

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request: instructions, the previous response's conversation, the new input."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += history + input_messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        for name in ("parallel_tool_calls", "temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        response_format = _response_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:  # harmony templates read it; others ignore it
            body["chat_template_kwargs"] = {"reasoning_effort": effort}
        chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, json.dumps(body).encode())
        return chat

    def input_items(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return list(self.input)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    conversation: list[dict[str, Any]]  # chat messages: its input (no instructions) and its output


class ResponseStore:
    """The last `capacity` stored responses, least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
