"""Tool calls: the schema that forces one, and parsing them out of the model's text.

Two output formats are recognised (`tool_choice` "auto"):
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, possibly after
  some text (what the tokenizer's tool prompt asks for when the template has none);
- Llama 3 JSON: the whole reply is `{"name": ..., "parameters": {...}}` (or a list of them, or
  several separated by ";"), optionally after `<|python_tag|>`.
A block whose name is not one of the request's tools is left as text.

With `tool_choice` "required" or a named function the reply is constrained by a JSON schema:
for a named function the reply is that function's arguments (streamed as argument deltas as it
is generated); for "required" it is a list of `{"name", "parameters"}` objects.

Parsers are incremental: `feed(text)` returns what can be sent now (content text that cannot be
part of a call, and whole calls as their closing tag arrives), `finish()` the rest.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True)
class ToolCallDelta:
    """A new call (`id` and `name` set) or more argument text for call `index`."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_choice_schema(tools: list[dict[str, Any]], forced: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema of a forced reply: the named function's arguments, or a list of calls.

    In the list, a tool whose parameters use references (`$ref` to its `$defs`, or to itself) is
    moved under the root's `$defs` as `tool_<name>` and its references rewritten to point there,
    so every definition it needs stays reachable from the new root."""

    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    if forced is not None:
        return parameters(next(t for t in tools if t["function"]["name"] == forced))
    defs: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for t in tools:
        name = t["function"]["name"]
        params = parameters(t)
        if _has_ref(params):
            defs[f"tool_{name}"] = _rebase_refs(params, f"#/$defs/tool_{name}")
            params = {"$ref": f"#/$defs/tool_{name}"}
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})  # fmt: skip
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("$ref"), str) or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of `node` whose local references (`#`, `#/...`) point below `base` instead."""
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _as_call(obj: Any, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) if `obj` is a call of a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return str(obj["name"]), json.dumps(args, ensure_ascii=False)


def parse_json_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """Llama 3 style: the whole text is one call, a list of calls, or calls separated by ';'."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    candidates: list[Any] = []
    try:
        value = json.loads(body)
        candidates = value if isinstance(value, list) else [value]
    except ValueError:
        try:
            candidates = [json.loads(part) for part in body.split(";") if part.strip()]
        except ValueError:
            return None
    calls = [_as_call(c, names) for c in candidates]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that starts `marker` (and could still complete it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class BaseToolParser:
    def __init__(self, names: list[str], parallel: bool = True) -> None:
        self.names = set(names)
        self.parallel = parallel
        self.count = 0  # calls started

    @property
    def called(self) -> bool:
        return self.count > 0

    def _call(self, name: str, arguments: str) -> list[ToolCallDelta]:
        if self.count and not self.parallel:
            return []  # parallel_tool_calls=false: only the first call counts
        self.count += 1
        return [ToolCallDelta(self.count - 1, arguments, new_call_id(), name)]

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError


class AutoToolParser(BaseToolParser):
    """tool_choice "auto": text, Hermes blocks or a Llama JSON reply."""

    def __init__(self, names: list[str], parallel: bool = True) -> None:
        super().__init__(names, parallel)
        self.buf = ""
        self.mode = "text"  # "text" | "block" (inside <tool_call>) | "json" (whole reply is JSON)
        self.sent_text = False

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while True:
            if self.mode == "json":
                return out
            if self.mode == "block":
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                self._block(self.buf[len(OPEN) : end], out)
                self.buf = self.buf[end + len(CLOSE) :]
                self.mode = "text"
                continue
            stripped = self.buf.lstrip()
            if not self.sent_text and not self.called:
                if not stripped or (len(stripped) < len(PYTHON_TAG) and PYTHON_TAG.startswith(stripped)):
                    return out  # only whitespace, or maybe the start of <|python_tag|>
                if stripped[0] in "{[" or stripped.startswith(PYTHON_TAG):
                    self.mode = "json"
                    return out
            start = self.buf.find(OPEN)
            if start >= 0:
                self._text(self.buf[:start], out)
                self.buf = self.buf[start:]
                self.mode = "block"
                continue
            hold = _held_prefix(self.buf, OPEN)
            self._text(self.buf[: len(self.buf) - hold], out)
            self.buf = self.buf[len(self.buf) - hold :]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        rest, self.buf = self.buf, ""
        if self.mode == "json":
            calls = parse_json_calls(rest, self.names)
            if calls is not None:
                for name, args in calls:
                    out.calls += self._call(name, args)
                return out
        elif self.mode == "block":
            body = rest[len(OPEN) :]
            if self._block(body, out):  # the model stopped before the closing tag
                return out
        self._text(rest, out)
        return out

    def _block(self, body: str, out: ParsedDelta) -> bool:
        try:
            call = _as_call(json.loads(body.strip()), self.names)
        except ValueError:
            call = None
        if call is None:
            self._text(OPEN + body + CLOSE, out)
            return False
        out.calls += self._call(*call)
        return True

    def _text(self, text: str, out: ParsedDelta) -> None:
        if self.called and not text.strip():
            return  # whitespace between or after calls
        if text:
            out.content += text
            self.sent_text = True


class NamedToolParser(BaseToolParser):
    """A named tool_choice: the whole reply is the arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__([name])
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if not self.called:
            return ParsedDelta(calls=self._call(self.name, text))
        return ParsedDelta(calls=[ToolCallDelta(0, text)])

    def finish(self) -> ParsedDelta:
        if not self.called:  # an empty reply is still the forced call
            return ParsedDelta(calls=self._call(self.name, ""))
        return ParsedDelta()


class RequiredToolParser(BaseToolParser):
    """tool_choice "required": a JSON list of {"name", "parameters"}, parsed once complete."""

    def __init__(self, names: list[str], parallel: bool = True) -> None:
        super().__init__(names, parallel)
        self.buf = ""

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        calls = parse_json_calls(self.buf, self.names)
        if calls is None:  # cut short (max_tokens): keep the calls that are complete
            calls = _complete_items(self.buf, self.names)
        if not calls:
            return ParsedDelta(content=self.buf)
        out = ParsedDelta()
        for name, args in calls:
            out.calls += self._call(name, args)
        return out


def _complete_items(text: str, names: set[str]) -> list[tuple[str, str]]:
    """The whole calls at the start of a JSON list that was cut off."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    calls: list[tuple[str, str]] = []
    while 0 < pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            break
        call = _as_call(obj, names)
        if call is None:
            break
        calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \n\t,":
            pos += 1
    return calls
