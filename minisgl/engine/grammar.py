"""Structured output with xgrammar: JSON schema, any JSON object, or a regular expression.

`GrammarBackend` compiles a request's constraint once (cached by kind and text) against the
model's tokenizer; `GrammarState` is one request's matcher. The scheduler advances the matcher
with every accepted token and ends the request when it terminates (a stop token was accepted);
the engine asks each constrained row for its next-token bitmask before sampling, and
`apply_token_bitmask` masks the logits in plain torch, so CPU and CUDA share one path.

JSON is generated without free whitespace (`{"a": 1, "b": [2, 3]}` style): small models given
free whitespace tend to emit newlines forever instead of closing the object.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.core import SamplingParams

_CACHE_ENTRIES = 256
GrammarKey = tuple[str, str]  # (kind, text): ("json_schema", schema) / ("json_object", "") / ("regex", pattern)


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    if params.json_object:
        return ("json_object", "")
    if params.regex is not None:
        return ("regex", params.regex)
    return None


def bitmask_width(vocab: int) -> int:
    return -(-vocab // 32)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; `bitmask` int32 [len(rows), W], bit t % 32 of word t // 32 set = token t
    allowed (xgrammar's layout). Returns a new tensor with disallowed tokens of `rows` at -inf."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of a host int32 bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, index)


class GrammarBackend:
    def __init__(self, model_dir: Path, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        if not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise ValueError("structured output needs the model's tokenizer, and this checkpoint has none")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)))
        self._compiled: dict[GrammarKey, Any] = {}

    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of `key`; an invalid schema or regex raises ValueError."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        kind, text = key
        try:
            if kind == "json_schema":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except ValueError:
            raise
        except Exception as exc:  # xgrammar reports bad input with its own exception types
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {exc}") from exc
        if len(self._compiled) >= _CACHE_ENTRIES:
            del self._compiled[next(iter(self._compiled))]  # oldest first
        self._compiled[key] = compiled
        return compiled

    def new_state(self, params: SamplingParams) -> GrammarState | None:
        key = grammar_key(params)
        return None if key is None else GrammarState(self.compile(key))
