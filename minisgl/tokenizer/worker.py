"""The tokenizer process: chat template, tokenization and request validation.

For each `TokenizeMsg` it either rejects the request (`ErrorMsg` straight to the API server) or
sends `TokenizedMsg`, carrying what the detokenizer needs to know (`DetokFacts`: stop strings,
prompt tail, replica), to the scheduler of the replica the router picks (`router.py`; one replica
without `--dp`). The API server's aborts are forwarded to the request's replica on the same
socket as the requests, so a scheduler always sees a request before its abort.

`RequestTokenizer` is the whole request logic (template, validation, context fit); the offline
`LLM` calls the same object in-process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from minisgl.core import SamplingParams
from minisgl.message.codec import WIRE
from minisgl.message.frontend import DetokenizedMsg, ErrorMsg, QueryErrorMsg, QueryReply, TokensMsg
from minisgl.message.scheduler import AbortMsg, ShutdownMsg, TokenizedMsg
from minisgl.message.tokenizer import (
    ChatPrompt,
    DetokenizeQueryMsg,
    DetokFacts,
    FinishedMsg,
    Prompt,
    TextPrompt,
    TokenizeMsg,
    TokenizeQueryMsg,
    TokenPrompt,
)
from minisgl.tokenizer.chat import ChatRenderer, ChatTemplateError
from minisgl.tokenizer.incremental import PROMPT_TAIL
from minisgl.tokenizer.router import ReplicaRouter
from minisgl.utils.logging import get_logger
from minisgl.utils.process import ReadyReporter
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = get_logger(__name__)


@dataclass(frozen=True)
class TokenizerAddrs:
    recv: str  # requests, queries and aborts; with --dp also the replicas' `FinishedMsg`
    schedulers: tuple[str, ...]  # rank 0 of each replica
    frontend: str


class PromptError(ValueError):
    """A request its prompt makes invalid (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class Tokenized(NamedTuple):
    msg: TokenizedMsg  # for the scheduler, with the detokenizer's facts
    prompt_text: str | None  # the text the ids came from (templated for chats; None for ids)


def load_hf_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class RequestTokenizer:
    """Turns a `TokenizeMsg` into the scheduler's request, or into an error for the client."""

    def __init__(self, tokenizer: Any, context_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.chat = ChatRenderer(tokenizer)

    def handle(self, msg: TokenizeMsg) -> TokenizedMsg | ErrorMsg:
        try:
            return self.tokenize(msg).msg
        except PromptError as exc:
            return ErrorMsg(msg.rid, str(exc), 400, exc.param)

    def tokenize(self, msg: TokenizeMsg) -> Tokenized:
        """The validated request, or PromptError."""
        param = "messages" if isinstance(msg.prompt, ChatPrompt) else "prompt"
        self._check_token_ids(msg.sampling)
        ids, text = self._encode(msg.prompt)
        sampling = self._fit(msg, len(ids), param)
        facts = DetokFacts(
            msg.rid, ids[-PROMPT_TAIL:], list(msg.stop), stop_token_ids=list(sampling.stop_token_ids),
            include_stop=msg.include_stop, min_tokens=sampling.min_tokens, echo_ids=ids if msg.echo else [],
        )  # fmt: skip
        return Tokenized(TokenizedMsg(msg.rid, ids, sampling, msg.max_tokens_explicit, facts, msg.pooling), text)

    def query(self, msg: TokenizeQueryMsg | DetokenizeQueryMsg) -> QueryReply:
        """`/tokenize` and `/detokenize`."""
        try:
            if isinstance(msg, TokenizeQueryMsg):
                return TokensMsg(msg.query_id, self.encode(msg.prompt, msg.add_special_tokens, allow_empty=True))
            self._check_range(msg.token_ids, "tokens")
            return DetokenizedMsg(msg.query_id, str(self.tokenizer.decode(msg.token_ids)))
        except PromptError as exc:
            return QueryErrorMsg(msg.query_id, str(exc), exc.param)

    def _check_range(self, ids: list[int], param: str) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):  # the common case, at C speed
            return
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of range [0, {self.vocab_size})", param)

    def _check_token_ids(self, sampling: SamplingParams) -> None:
        self._check_range(list(sampling.logit_bias), "logit_bias")
        self._check_range(sampling.stop_token_ids, "stop_token_ids")

    def encode(self, prompt: Prompt, add_special_tokens: bool = True, allow_empty: bool = False) -> list[int]:
        return self._encode(prompt, add_special_tokens, allow_empty)[0]

    def _encode(
        self, prompt: Prompt, add_special_tokens: bool = True, allow_empty: bool = False
    ) -> tuple[list[int], str | None]:
        text: str | None
        if isinstance(prompt, TextPrompt):
            text = prompt.text
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            param = "prompt"
        elif isinstance(prompt, ChatPrompt):
            text = self.render_chat(prompt)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            param = "messages"
        else:
            assert isinstance(prompt, TokenPrompt)
            text, ids = None, list(prompt.input_ids)
            self._check_range(ids, "prompt")
            param = "prompt"
        if not ids and not allow_empty:
            raise PromptError("the prompt is empty", param)
        return ids, text

    def render_chat(self, prompt: ChatPrompt) -> str:
        try:
            return self.chat.render(prompt)
        except ChatTemplateError as exc:
            raise PromptError(str(exc), "messages") from None

    def _fit(self, msg: TokenizeMsg, prompt_len: int, param: str) -> SamplingParams:
        ctx = self.context_len
        if prompt_len >= ctx:
            raise PromptError(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{prompt_len} tokens. Please shorten the {param}.",
                param,
            )
        max_tokens = msg.sampling.max_tokens
        if not msg.max_tokens_explicit:
            room = min(max_tokens, ctx - prompt_len)
            if msg.sampling.min_tokens > room:
                raise PromptError(
                    f"min_tokens is {msg.sampling.min_tokens}, but only {room} tokens fit in the context "
                    f"after the {prompt_len} tokens of the {param}", "min_tokens",
                )  # fmt: skip
            return dataclasses.replace(msg.sampling, max_tokens=room)
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
    recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv, WIRE)
    to_scheds: list[ZmqPushQueue[object]] = [ZmqPushQueue(addr, WIRE) for addr in addrs.schedulers]
    router = ReplicaRouter(len(to_scheds))
    to_front: ZmqPushQueue[object] = ZmqPushQueue(addrs.frontend, WIRE)
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
                replica = router.assign(msg.rid, len(result.input_ids) + result.sampling.max_tokens)
                if replica and result.facts is not None:
                    result.facts.replica = replica
                to_scheds[replica].put(result)
        elif isinstance(msg, (TokenizeQueryMsg, DetokenizeQueryMsg)):
            to_front.put(worker.query(msg))
        elif isinstance(msg, AbortMsg):
            owner = router.owner(msg.rid)
            if owner is not None:  # else it has ended already
                to_scheds[owner].put(msg)
        elif isinstance(msg, FinishedMsg):
            router.finished(msg.rids)
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
