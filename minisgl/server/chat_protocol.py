"""The chat completions body: messages (tool turns included), tools, tool_choice, logprobs.

Validated as strictly as the rest of protocol.py: a field or value the server cannot honour is a
400 that names it. Messages are the exception, parsed as leniently as vLLM's: a message's unknown
fields are ignored and custom roles go to the chat template (docs/openai_api.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import field_validator, model_validator

from minisgl.core import SamplingParams
from minisgl.server.protocol import NAME_PATTERN, RequestError, _SamplingFields, schema_problem, structured_output
from minisgl.server.tools import tool_choice_schema

# Template variables the server sets itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "chat_template", "tokenize", "return_dict", "add_generation_prompt",
     "continue_final_message", "conversation"}
)  # fmt: skip

ToolMode = Literal["none", "auto", "required", "named"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not v:
            raise ValueError("messages must not be empty")
        messages = [check_message(i, m) for i, m in enumerate(v)]
        if len(messages) >= 2 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
            raise ValueError("the conversation may end with at most one assistant message (the one continued)")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v is None:
            return None
        names = [check_tool(i, tool) for i, tool in enumerate(v)]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(v or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"'{reserved[0]}' is set by the server and cannot be passed to the template")
        return v

    @model_validator(mode="after")
    def _consistency(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        mode = self.tool_mode  # validates tool_choice
        if mode in ("required", "named"):
            json_schema, json_object = structured_output(self.response_format)
            if json_schema is not None or json_object or self.regex is not None:
                raise RequestError("a forced tool call (tool_choice required or named) cannot be combined "
                                   "with response_format or regex", "tool_choice")  # fmt: skip
        return self

    @property
    def tool_mode(self) -> ToolMode:
        choice = self.tool_choice
        names = self.tool_names
        if choice is None:
            return "auto" if names else "none"
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise RequestError("tool_choice must be 'none', 'auto', 'required' or "
                                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip
            if choice != "none" and not names:
                raise RequestError(f"tool_choice '{choice}' needs 'tools'", "tool_choice")
            return choice  # type: ignore[return-value]
        function = choice.get("function")
        if set(choice) != {"type", "function"} or choice.get("type") != "function" or not isinstance(function, dict) \
                or set(function) != {"name"}:  # fmt: skip
            raise RequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if function["name"] not in names:
            raise RequestError(f"tool_choice names '{function['name']}', which is not in 'tools'", "tool_choice")
        return "named"

    @property
    def tool_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools or []]

    @property
    def forced_tool(self) -> str | None:
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"])
        return None

    def prompt_tools(self) -> list[dict[str, Any]]:
        """Tools shown to the model: none with tool_choice 'none'."""
        return [] if self.tool_mode == "none" else list(self.tools or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return ((self.top_logprobs or 0) if self.logprobs else None), None

    def field_name(self, param: str) -> str:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if param == "logprobs" and self.top_logprobs is not None else param

    def sampling(self, default_max_tokens: int) -> tuple[SamplingParams, bool]:
        params, explicit = super().sampling(default_max_tokens)
        mode = self.tool_mode
        if mode in ("required", "named"):  # the forced call's grammar (validated with response_format above)
            schema = tool_choice_schema(self.tools or [], self.forced_tool, self.parallel_tool_calls is not False)
            params = replace(params, json_schema=json.dumps(schema, ensure_ascii=False))
        return params, explicit


def check_tool(index: int, tool: Any) -> str:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
        raise ValueError(f"{where}: a tool is {{'type': 'function', 'function': {{...}}}}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object")
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise ValueError(f"{where}.function: unsupported field '{sorted(extra)[0]}'")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    if not isinstance(function.get("description", ""), str):
        raise ValueError(f"{where}.function.description must be a string")
    problem = schema_problem(function.get("parameters", {}))
    if problem is not None:
        raise ValueError(f"{where}.function.parameters is not a valid JSON schema: {problem}")
    return name


def check_message(index: int, message: Any) -> dict[str, Any]:
    """One message, as leniently as vLLM: fields the server does not know are ignored, and a role
    other than the five OpenAI ones is handed to the chat template as it is."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message is an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}: 'role' must be a non-empty string (system, user, assistant, developer, tool "
                         "or a role the chat template knows)")  # fmt: skip
    content = message.get("content")
    calls = message.get("tool_calls")
    if content is None and role != "assistant":
        raise ValueError(f"{where}: 'content' is required")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: content part type {kind!r} is not supported, only 'text'")
            if not isinstance(part.get("text"), str):  # other fields of a part are ignored
                raise ValueError(f"{where}.content[{j}]: a text part is {{'type': 'text', 'text': <string>}}")
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}: 'content' must be a string or a list of text parts")
    if "name" in message and not isinstance(message["name"], str):
        raise ValueError(f"{where}: 'name' must be a string")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ValueError(f"{where}: a tool message needs 'tool_call_id' (string)")
        out["tool_call_id"] = message["tool_call_id"]
    elif "tool_call_id" in message:
        raise ValueError(f"{where}: 'tool_call_id' is only for role 'tool'")
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{where}: 'tool_calls' is only for role 'assistant'")
        out["tool_calls"] = [_check_call(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(calls)]
    if "name" in message and role != "developer":
        out["name"] = message["name"]
    return out


def _check_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise ValueError(f"{where}: a tool call is {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    function: Any = call.get("function")
    valid = isinstance(function, dict) and isinstance(function.get("name"), str) \
        and isinstance(function.get("arguments", "{}"), str)
    if not valid:
        raise ValueError(f"{where}.function must be {{'name': <string>, 'arguments': <JSON string>}}")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}}  # fmt: skip
