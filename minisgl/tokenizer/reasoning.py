"""Reasoning parsers: a reply's text deltas split into the thinking and the answer.

`--reasoning-parser` (server) / `LLM(reasoning_parser=...)` (offline) names one of `REASONING_PARSERS`.
The tokenizer stage decides per chat request where the output starts (`starts_in_reasoning`, from
the rendered prompt: a template may already have opened `<think>`); the detokenizer runs one
parser per request on the text it emits (after stop strings were cut), so every front end (chat,
Anthropic, Responses, offline) gets the same split: `TextDelta.reasoning` and `TextDelta.text`.
Tool-call parsing then runs on the answer only.

- `qwen3`: `<think>...</think>` at the start of the reply; without `<think>` the reply is the answer
  (unless the prompt ended inside an open `<think>`).
- `deepseek_r1`: the same tags, but the reply starts as thinking (R1 models often omit `<think>`)
  unless thinking was turned off (`enable_thinking` / `thinking` false) or the prompt closed it.
- `gpt_oss`: harmony messages (`<|channel|>analysis<|message|>...<|end|>` is thinking, the `final`
  channel the answer; a `commentary` message to `functions.NAME` becomes a `<tool_call>` block of the
  answer, which the tool parser reads). Harmony's markers are special tokens, so requests of this
  parser are decoded with special tokens kept (`keeps_special_tokens`).

Tags are found across delta boundaries (a tag's possible beginning is held back), and never
appear in either output, whole or cut short: a reply that ends inside a tag (max_tokens, a stop
string) drops the partial tag. Newlines right inside the think tags and before the answer are
dropped, as the templates write them back.
"""

from __future__ import annotations

import json
from typing import ClassVar, NamedTuple

from minisgl.core import SamplingParams
from minisgl.message.tokenizer import ChatPrompt, DetokFacts, Prompt

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningDelta(NamedTuple):
    reasoning: str = ""
    content: str = ""


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a strict prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def thinking_disabled(template_kwargs: dict[str, object]) -> bool:
    """`chat_template_kwargs` that turn thinking off (Qwen3's `enable_thinking`, DeepSeek's `thinking`)."""
    return template_kwargs.get("enable_thinking") is False or template_kwargs.get("thinking") is False


class BaseReasoningParser:
    """One request's splitter: `feed(text)` returns what can be sent now, `finish()` the rest."""

    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning

    @classmethod
    def starts_in_reasoning(cls, prompt: str, thinking: bool) -> bool:
        """Whether the reply to this rendered prompt begins inside the thinking."""
        raise NotImplementedError

    def feed(self, text: str) -> ReasoningDelta:
        raise NotImplementedError

    def finish(self) -> ReasoningDelta:
        raise NotImplementedError


class ThinkReasoningParser(BaseReasoningParser):
    """`<think>...</think>` then the answer (qwen3)."""

    def __init__(self, in_reasoning: bool) -> None:
        super().__init__(in_reasoning)
        self.buf = ""
        self.started = False  # past the optional leading <think>
        self.lead = in_reasoning  # at the start of a section after a tag: its leading newlines go

    @classmethod
    def starts_in_reasoning(cls, prompt: str, thinking: bool) -> bool:
        return thinking and prompt.rstrip().endswith(THINK_OPEN)

    def feed(self, text: str) -> ReasoningDelta:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if not self.started:
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf = head[len(THINK_OPEN) :]
                    self.started = self.in_reasoning = self.lead = True
                    continue
                if THINK_OPEN.startswith(head):  # blank, or maybe the start of <think>
                    break
                self.started = True
            if self.in_reasoning:
                end = self.buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._section(self.buf[:end].rstrip("\n")))
                    self.buf = self.buf[end + len(THINK_CLOSE) :]
                    self.in_reasoning, self.lead = False, True
                    continue
                hold = held_prefix(self.buf, THINK_CLOSE)
                body = self.buf[: len(self.buf) - hold]
                keep = body[len(body.rstrip("\n")) :]  # newlines that may come right before </think>
                reasoning.append(self._section(body[: len(body) - len(keep)]))
                self.buf = keep + self.buf[len(body) :]
                break
            content.append(self._section(self.buf, strip=" \t\n"))
            self.buf = ""
            break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _section(self, text: str, strip: str = "\n") -> str:
        if self.lead:
            text = text.lstrip(strip)
            self.lead = not text
        return text

    def finish(self) -> ReasoningDelta:
        rest, self.buf = self.buf, ""
        if not self.started:
            head = rest.lstrip()
            if self.in_reasoning or (head and THINK_OPEN.startswith(head)):
                return ReasoningDelta()  # blank, or a cut-off <think>
            return ReasoningDelta("", rest)
        if self.in_reasoning:  # held: trailing newlines and maybe the start of </think>
            return ReasoningDelta(self._section(rest[: len(rest) - held_prefix(rest, THINK_CLOSE)].rstrip("\n")))
        return ReasoningDelta("", self._section(rest, strip=" \t\n"))


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """The reply starts as thinking (with or without `<think>`) until `</think>`."""

    @classmethod
    def starts_in_reasoning(cls, prompt: str, thinking: bool) -> bool:
        return thinking and not prompt.rstrip().endswith(THINK_CLOSE)


HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY_MESSAGE = "<|message|>"
HARMONY_CHANNEL = "<|channel|>"


class HarmonyReasoningParser(BaseReasoningParser):
    """gpt-oss harmony messages: a header (`<|start|>assistant<|channel|>NAME [to=RECIPIENT]
    [<|constrain|>json]`), `<|message|>`, the body, and `<|end|>` / `<|call|>` / `<|return|>`."""

    keeps_special_tokens = True

    def __init__(self, in_reasoning: bool) -> None:
        super().__init__(in_reasoning)
        self.buf = ""
        self.in_body = in_reasoning
        self.channel = "analysis" if in_reasoning else ""
        self.recipient = ""
        self.call_body = ""  # a function call's arguments, sent whole at its end
        self.saw_marker = in_reasoning

    @classmethod
    def starts_in_reasoning(cls, prompt: str, thinking: bool) -> bool:
        tail = prompt[prompt.rfind("<|start|>") :] if "<|start|>" in prompt else ""
        return tail.replace(" ", "").endswith(HARMONY_CHANNEL + "analysis" + HARMONY_MESSAGE)

    def feed(self, text: str) -> ReasoningDelta:
        self.buf += text
        out = ReasoningDelta()
        while True:
            if not self.in_body:
                start = self.buf.find(HARMONY_MESSAGE)
                if start < 0:
                    self.saw_marker = self.saw_marker or "<|" in self.buf
                    return out
                self._header(self.buf[:start])
                self.buf = self.buf[start + len(HARMONY_MESSAGE) :]
                self.in_body = self.saw_marker = True
                continue
            ends = [(pos, mark) for mark in HARMONY_ENDS if (pos := self.buf.find(mark)) >= 0]
            if ends:
                pos, mark = min(ends)
                out = _join(out, self._body(self.buf[:pos]), self._end())
                self.buf = self.buf[pos + len(mark) :]
                continue
            hold = max(held_prefix(self.buf, mark) for mark in HARMONY_ENDS)
            out = _join(out, self._body(self.buf[: len(self.buf) - hold]))
            self.buf = self.buf[len(self.buf) - hold :]
            return out

    def _header(self, header: str) -> None:
        words = header.replace(HARMONY_CHANNEL, " <channel> ").replace("<|constrain|>", " ").split()
        self.channel = words[words.index("<channel>") + 1] if "<channel>" in words[:-1] else ""
        self.recipient = next((w[3:] for w in words if w.startswith("to=")), "")
        self.call_body = ""

    def _body(self, text: str) -> ReasoningDelta:
        if self.channel == "analysis":
            return ReasoningDelta(text, "")
        if self.recipient.startswith("functions."):
            self.call_body += text
            return ReasoningDelta()
        return ReasoningDelta("", text)

    def _end(self) -> ReasoningDelta:
        self.in_body = False
        if not self.recipient.startswith("functions."):
            return ReasoningDelta()
        call = '{"name": ' + json.dumps(self.recipient.removeprefix("functions.")) + ', "arguments": '
        body, self.call_body = self.call_body.strip() or "{}", ""
        return ReasoningDelta("", "<tool_call>\n" + call + body + "}\n</tool_call>")

    def finish(self) -> ReasoningDelta:
        rest, self.buf = self.buf, ""
        if not self.in_body:  # a reply that never used harmony is all answer
            return ReasoningDelta("", rest) if not self.saw_marker else ReasoningDelta()
        body = rest[: len(rest) - max(held_prefix(rest, mark) for mark in HARMONY_ENDS)]
        out = self._body(body)
        return _join(out, self._end()) if self.recipient.startswith("functions.") else out


def _join(*parts: ReasoningDelta) -> ReasoningDelta:
    return ReasoningDelta("".join(p.reasoning for p in parts), "".join(p.content for p in parts))


REASONING_PARSERS: dict[str, type[BaseReasoningParser]] = {
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": HarmonyReasoningParser,
}


def reasoning_parser_class(name: str) -> type[BaseReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def make_reasoning_parser(name: str, in_reasoning: bool) -> BaseReasoningParser:
    return reasoning_parser_class(name)(in_reasoning)


def mark_reasoning(facts: DetokFacts, parser: str | None, prompt: Prompt, prompt_text: str | None,
                   sampling: SamplingParams) -> None:  # fmt: skip
    """The tokenizer stage's part: a chat request of a server with a reasoning parser gets it on its
    facts, with where its reply starts (from the rendered prompt and `enable_thinking`). A reply
    constrained by a grammar (json_schema, json_object, regex, a forced tool call) is the answer
    from its first token: it is not split."""
    constrained = sampling.json_schema is not None or sampling.json_object or sampling.regex is not None
    if parser is None or not isinstance(prompt, ChatPrompt) or prompt_text is None or constrained:
        return
    facts.reasoning_parser = parser
    thinking = not thinking_disabled(prompt.template_kwargs)
    facts.in_reasoning = reasoning_parser_class(parser).starts_in_reasoning(prompt_text, thinking)
