"""The tokenizer process: chat template, tokenization and request validation.

For each `TokenizeMsg` it either rejects the request (`ErrorMsg` straight to the API server) or
registers it with the detokenizer (stop strings, prompt tail) and then sends `TokenizedMsg` to the
scheduler. Aborts are forwarded on the same socket as the requests, so the scheduler always sees
a request before its abort.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minisgl.message.frontend import ErrorMsg
from minisgl.message.scheduler import AbortMsg, ShutdownMsg, TokenizedMsg
from minisgl.message.tokenizer import (
    ChatPrompt,
    DetokRegisterMsg,
    Prompt,
    TextPrompt,
    TokenizeMsg,
    TokenPrompt,
)
from minisgl.tokenizer.incremental import PROMPT_TAIL
from minisgl.utils.logging import get_logger
from minisgl.utils.process import ReadyReporter
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = get_logger(__name__)

# Used when a tokenizer ships no chat template: ChatML, which most instruct models understand.
_FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TokenizerAddrs:
    recv: str
    scheduler: str
    detokenizer: str
    frontend: str


class PromptError(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def load_hf_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def flatten_content(content: Any) -> str:
    """OpenAI content: a string, None, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


class RequestTokenizer:
    """Turns a `TokenizeMsg` into the scheduler's request, or into an error for the client."""

    def __init__(self, tokenizer: Any, context_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.template = getattr(tokenizer, "chat_template", None) or _FALLBACK_TEMPLATE

    def handle(self, msg: TokenizeMsg) -> tuple[DetokRegisterMsg, TokenizedMsg] | ErrorMsg:
        param = "messages" if isinstance(msg.prompt, ChatPrompt) else "prompt"
        try:
            ids = self.encode(msg.prompt)
            sampling = self._fit(msg, len(ids), param)
        except PromptError as exc:
            return ErrorMsg(msg.rid, str(exc), 400, exc.param)
        register = DetokRegisterMsg(msg.rid, ids[-PROMPT_TAIL:], list(msg.stop))
        return register, TokenizedMsg(msg.rid, ids, sampling, msg.max_tokens_explicit)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TextPrompt):
            ids = list(self.tokenizer.encode(prompt.text, add_special_tokens=True))
            param = "prompt"
        elif isinstance(prompt, ChatPrompt):
            ids = list(self.tokenizer.encode(self.render_chat(prompt), add_special_tokens=False))
            param = "messages"
        else:
            assert isinstance(prompt, TokenPrompt)
            ids = list(prompt.input_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(f"token id {bad[0]} is out of range [0, {self.vocab_size})", "prompt")
            param = "prompt"
        if not ids:
            raise PromptError("the prompt is empty", param)
        return ids

    def render_chat(self, prompt: ChatPrompt) -> str:
        messages = [{"role": m["role"], "content": flatten_content(m.get("content"))} for m in prompt.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # templates raise on conversations they do not accept
            raise PromptError(f"the chat template rejected the messages: {exc}", "messages") from None
        return str(text)

    def _fit(self, msg: TokenizeMsg, prompt_len: int, param: str) -> Any:
        ctx = self.context_len
        if prompt_len >= ctx:
            raise PromptError(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{prompt_len} tokens. Please shorten the {param}.",
                param,
            )
        max_tokens = msg.sampling.max_tokens
        if not msg.max_tokens_explicit:
            return dataclasses.replace(msg.sampling, max_tokens=min(max_tokens, ctx - prompt_len))
        if prompt_len + max_tokens > ctx:
            raise PromptError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {param} or of max_tokens.",
                "max_tokens",
            )
        return msg.sampling


def run_tokenizer(model_dir: str, context_len: int, addrs: TokenizerAddrs, ready: ReadyReporter) -> None:
    """Process entry point."""
    recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv)
    to_sched: ZmqPushQueue[object] = ZmqPushQueue(addrs.scheduler)
    to_detok: ZmqPushQueue[object] = ZmqPushQueue(addrs.detokenizer)
    to_front: ZmqPushQueue[object] = ZmqPushQueue(addrs.frontend)
    tokenizer = load_hf_tokenizer(model_dir)
    vocab = _vocab_size(model_dir, tokenizer)
    worker = RequestTokenizer(tokenizer, context_len, vocab)
    ready.ready()
    while True:
        msg = recv.get()
        if isinstance(msg, TokenizeMsg):
            result = worker.handle(msg)
            if isinstance(result, ErrorMsg):
                to_front.put(result)
            else:
                to_detok.put(result[0])  # before the scheduler can produce output for it
                to_sched.put(result[1])
        elif isinstance(msg, AbortMsg):
            to_sched.put(msg)
        elif isinstance(msg, ShutdownMsg):
            break
        else:
            logger.warning("tokenizer: ignoring unexpected message %s", type(msg).__name__)


def _vocab_size(model_dir: str, tokenizer: Any) -> int:
    from minisgl.models.config import ModelConfig

    try:
        return ModelConfig.from_dir(model_dir).vocab_size
    except (OSError, ValueError, KeyError):
        return len(tokenizer)
