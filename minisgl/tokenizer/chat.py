"""Chat prompts -> text: the model's chat template, with OpenAI tools and tool turns.

Templates that know about tools (their source mentions `tools`, e.g. Qwen2.5/Qwen3, Llama 3.1+,
Hermes) get the tools and the tool turns as Hugging Face defines them: `tools=[...]`, assistant
`tool_calls` with `arguments` as an object, `tool` messages with their `tool_call_id`.

Templates without tool support (the embedded SmolLM2 among them) get the Hermes/Qwen2.5
convention written into the conversation instead, so a model can still be asked to call tools:
- the system message (one is added when there is none) ends with

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {...}}      (one tool per line, as JSON)
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

- an assistant turn's `tool_calls` become `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
  blocks after its content;
- consecutive `tool` messages become one `user` turn of `<tool_response>\n...\n</tool_response>`
  blocks.
The server parses `<tool_call>` blocks out of the reply (minisgl.server.tools).
"""

from __future__ import annotations

import json
from typing import Any

from minisgl.message.tokenizer import ChatPrompt

# Used when a tokenizer ships no chat template: ChatML, which most instruct models understand.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (HTTP 400 on `messages`)."""


def flatten_content(content: Any) -> str:
    """OpenAI content: a string, None, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def _arguments(raw: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates want the object."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _template_source(template: Any) -> str:
    return template if isinstance(template, str) else json.dumps(template)


class ChatRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
        # Some tokenizers ship named templates ({"default": ..., "tool_use": ...}).
        self.templates: dict[str, str] = template if isinstance(template, dict) else {"default": template}

    def _template(self, with_tools: bool) -> str:
        if with_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default") or next(iter(self.templates.values()))

    @staticmethod
    def supports_tools(template: str) -> bool:
        return "tools" in _template_source(template)

    def render(self, prompt: ChatPrompt) -> str:
        kwargs = dict(prompt.template_kwargs)
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        uses_tools = bool(prompt.tools) or any(
            m.get("role") == "tool" or m.get("tool_calls") for m in prompt.messages
        )
        template = self._template(uses_tools)
        if self.supports_tools(template):
            messages = [_native_message(m) for m in prompt.messages]
            if prompt.tools:
                kwargs["tools"] = prompt.tools
        else:
            messages = _inline_tools(prompt.messages, prompt.tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs,
            )  # fmt: skip
        except Exception as exc:  # templates raise on conversations they do not accept
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
        return str(text)


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": message["role"], "content": flatten_content(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": call.get("id"), "type": "function",
             "function": {"name": call["function"]["name"], "arguments": _arguments(call["function"].get("arguments"))}}
            for call in message["tool_calls"]
        ]  # fmt: skip
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    return out


def tools_system_block(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def _tool_call_block(call: dict[str, Any]) -> str:
    body = {"name": call["function"]["name"], "arguments": _arguments(call["function"].get("arguments"))}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def _inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = flatten_content(message.get("content"))
        if role == "tool":
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_tool_call_block(call) for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        block = tools_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + block) if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
