"""The request's entry: one `TokenizeMsg` in, the scheduler's `TokenizedMsg` (or a 400) out.

`RequestTokenizer` is the whole request logic of the tokenizer stage: chat template, tokens,
and every check of a request's content against the engine it will run on (`EngineLimitsMsg`):
a non-empty prompt inside the context, token ids inside the vocabulary (prompt, logit_bias,
stop_token_ids), and a worst case that the KV pool can hold; an unset max_tokens is lowered to
what fits, here and nowhere else. The sampling values themselves were checked where the request
was built (`SamplingParams`). The tokenizer process (`worker.py`) runs this object; the offline
`LLM` and so the shell's path too call the same class in-process, so every front end gets the
same checks with the same messages. Nothing here imports zmq.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

from minisgl.core import SamplingParams
from minisgl.message.frontend import DetokenizedMsg, ErrorMsg, QueryErrorMsg, QueryReply, TokensMsg
from minisgl.message.scheduler import TokenizedMsg
from minisgl.message.tokenizer import (
    ChatPrompt,
    DetokenizeQueryMsg,
    DetokFacts,
    EngineLimitsMsg,
    Prompt,
    TextPrompt,
    TokenizeMsg,
    TokenizeQueryMsg,
    TokenPrompt,
)
from minisgl.tokenizer.chat import ChatRenderer, ChatTemplateError
from minisgl.tokenizer.incremental import PROMPT_TAIL
from minisgl.tokenizer.reasoning import mark_reasoning, reasoning_parser_class


class PromptError(ValueError):
    """A request its prompt makes invalid (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class Tokenized(NamedTuple):
    msg: TokenizedMsg  # for the scheduler, with the detokenizer's facts
    prompt_text: str | None  # the text the ids came from (templated for chats; None for ids)


# `tokenizer_class` values of tokenizer_config.json that AutoTokenizer maps to transformers'
# generic class over a tokenizer.json (TokenizersBackend; PreTrainedTokenizerFast is its old name).
_GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def generic_tokenizer_dir(model_dir: str) -> bool:
    """Whether AutoTokenizer would load `model_dir`'s tokenizer as transformers' generic class
    (a tokenizer.json, and tokenizer_config.json naming that class, as minisgl's GGUF tokenizer
    directories do)."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        return False
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES


def load_hf_tokenizer(model_dir: str) -> Any:
    """The model's Hugging Face tokenizer, as AutoTokenizer loads it. The generic class is
    imported on its own: AutoTokenizer imports torch (~250 MB in the tokenizer process, which
    needs none), the module of the generic class does not."""
    if generic_tokenizer_dir(model_dir):
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as generic
        except ImportError:  # transformers 4: the same class under its old name
            from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as generic

        return generic.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class RequestTokenizer:
    """Turns a `TokenizeMsg` into the scheduler's request, or into an error for the client."""

    def __init__(self, tokenizer: Any, limits: EngineLimitsMsg, reasoning_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_len = limits.context_len
        self.vocab_size = limits.vocab_size
        self.pool_tokens = limits.pool_tokens
        self.chat = ChatRenderer(tokenizer)
        self.reasoning_parser = reasoning_parser
        if reasoning_parser is not None:
            reasoning_parser_class(reasoning_parser)  # an unknown name fails at start-up

    def handle(self, msg: TokenizeMsg) -> TokenizedMsg | ErrorMsg:
        try:
            return self.tokenize(msg).msg
        except PromptError as exc:
            return ErrorMsg(msg.rid, str(exc), 400, exc.param)

    def tokenize(self, msg: TokenizeMsg) -> Tokenized:
        """The validated request, or PromptError."""
        param = "messages" if isinstance(msg.prompt, ChatPrompt) else "prompt"
        self._check_range(list(msg.sampling.logit_bias), "logit_bias")
        self._check_range(msg.sampling.stop_token_ids, "stop_token_ids")
        ids, text = self._encode(msg.prompt)
        if not isinstance(msg.prompt, TokenPrompt):  # (ids given by the client were checked by _encode)
            self._check_range(ids, param)  # a tokenizer may know more tokens than the model embeds
        sampling = self._fit(msg, len(ids), param)
        facts = DetokFacts(
            msg.rid, ids[-PROMPT_TAIL:], list(msg.stop), stop_token_ids=list(sampling.stop_token_ids),
            include_stop=msg.include_stop, min_tokens=sampling.min_tokens, echo_ids=ids if msg.echo else [],
        )  # fmt: skip
        mark_reasoning(facts, self.reasoning_parser, msg.prompt, text, sampling)
        return Tokenized(TokenizedMsg(msg.rid, ids, sampling, facts, msg.pooling, msg.lora), text)

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
        """The request's sampling with max_tokens inside the context and the KV pool: an unset
        one is lowered to what fits, a given one that does not fit is refused."""
        ctx, pool = self.context_len, self.pool_tokens
        if prompt_len >= ctx:
            raise PromptError(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{prompt_len} tokens. Please shorten the {param}.",
                param,
            )
        sampling = msg.sampling
        max_tokens, min_tokens = sampling.max_tokens, sampling.min_tokens
        if msg.max_tokens_explicit:
            if prompt_len + max_tokens > ctx:
                raise PromptError(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the "
                    f"completion). Please reduce the length of the {param} or of max_tokens.",
                    "max_tokens",
                )
            if prompt_len + max_tokens > pool:
                raise PromptError(_pool_message(prompt_len + max_tokens, pool, "lower max_tokens"), "max_tokens")
            return sampling
        room = min(max_tokens, ctx - prompt_len)
        if min_tokens > room:
            raise PromptError(
                f"min_tokens is {min_tokens}, but only {room} tokens fit in the context "
                f"after the {prompt_len} tokens of the {param}", "min_tokens",
            )  # fmt: skip
        least = prompt_len + max(1, min_tokens)  # the prompt and the tokens it must be given
        if least > pool:
            where = "min_tokens" if min_tokens and prompt_len < pool else param
            raise PromptError(_pool_message(least, pool, f"shorten the {where}"), where)
        return dataclasses.replace(sampling, max_tokens=min(room, pool - prompt_len))


def _pool_message(tokens: int, pool: int, remedy: str) -> str:
    return (f"the request needs up to {tokens} tokens of KV cache, more than the pool holds ({pool}); "
            f"raise --num-pages or {remedy}")  # fmt: skip
