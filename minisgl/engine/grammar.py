"""Structured output with xgrammar: JSON schema, any JSON object, or a regular expression.

`GrammarBackend` compiles a request's constraint once (cached by kind and text) against the
model's tokenizer; `GrammarState` is one request's matcher. The scheduler advances the matcher
with every accepted token and ends the request when it terminates (a stop token was accepted);
the engine asks each constrained row for its next-token bitmask before sampling, and
`apply_token_bitmask` masks the logits in plain torch, so CPU and CUDA share one path.

JSON is generated without free whitespace (`{"a": 1, "b": [2, 3]}` style): small models given
free whitespace tend to emit newlines forever instead of closing the object.

Compile time is bounded, since a request's grammar is compiled in the scheduler's loop. First,
deterministic limits that every TP rank applies alike refuse the known blow-ups cheaply
(`check_grammar`): the text's length, its nesting depth, counted repetitions (`{m,n}`, also in
a schema's patterns) and the properties of one schema object (xgrammar's time grows with the
cube of the optional ones: 200 take 0.3 s, 1000 take 24 s on 2 cores). Then a deadline
(`COMPILE_TIMEOUT_S`) bounds the rest (e.g. many large repetitions in a row): the compile runs
in a thread (xgrammar releases the GIL), and one not done in time is refused with a ValueError
(400). It finishes in the background and is cached; while it runs, other new grammars are
refused rather than piled up. The deadline is wall-clock time, so with --tp > 1 two ranks could
disagree about a grammar that compiles in just about that time.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.core import SamplingParams

_CACHE_ENTRIES = 256
MAX_REGEX_CHARS = 16_384
MAX_SCHEMA_CHARS = 65_536
MAX_DEPTH = 64  # brackets ([ { and regex groups) open at once
MAX_REPEAT = 10_000  # the largest m or n in a counted repetition {m,n}
MAX_PROPERTIES = 1_000  # of one schema object
MAX_OPTIONAL_PROPERTIES = 200  # of one schema object (not in its "required")
COMPILE_TIMEOUT_S = 10.0
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
GrammarKey = tuple[str, str]  # (kind, text): ("json_schema", schema) / ("json_object", "") / ("regex", pattern)


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    if params.json_object:
        return ("json_object", "")
    if params.regex is not None:
        return ("regex", params.regex)
    return None


def check_grammar(kind: str, text: str) -> None:
    """Raise ValueError if the grammar is beyond the compile limits (see the module docstring)."""
    label = kind.replace("_", " ")
    limit = MAX_SCHEMA_CHARS if kind == "json_schema" else MAX_REGEX_CHARS
    if len(text) > limit:
        raise ValueError(f"the {label} is too long to compile ({len(text)} characters, at most {limit})")
    for match in _REPEAT.finditer(text):
        count = max(int(match.group(1)), int(match.group(2) or 0))
        if count > MAX_REPEAT:
            raise ValueError(f"the {label} repeats {count} times in {match.group(0)!r}; at most {MAX_REPEAT}")
    if kind == "regex":
        depth = _depth(re.sub(r"\\.", "", text), "(", ")")
    else:
        depth = _depth(_STRING.sub('""', text), "[{", "]}")
    if depth > MAX_DEPTH:
        raise ValueError(f"the {label} nests {depth} levels deep; at most {MAX_DEPTH}")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError:
            return  # xgrammar says what is wrong with it
        _check_objects(schema)


def _depth(text: str, opening: str, closing: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif char in closing:
            depth -= 1
    return deepest


def _check_objects(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _check_objects(item)
        return
    if not isinstance(node, dict):
        return
    props = node.get("properties")
    if isinstance(props, dict):
        required = node.get("required")
        required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
        optional = len(set(props) - required)
        if len(props) > MAX_PROPERTIES:
            raise ValueError(f"a json schema object has {len(props)} properties; at most {MAX_PROPERTIES}")
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise ValueError(f"a json schema object has {optional} optional properties (not in 'required'); "
                             f"at most {MAX_OPTIONAL_PROPERTIES}")  # fmt: skip
    for value in node.values():
        _check_objects(value)


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
        self.timeout = COMPILE_TIMEOUT_S
        self._overdue: threading.Thread | None = None  # a compile past its deadline, still running

    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of `key`; an invalid, too large or too slow one raises ValueError."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        check_grammar(*key)
        if self._overdue is not None and self._overdue.is_alive():
            raise ValueError("the server is still compiling an earlier grammar that ran past its time limit; "
                             "retry later")  # fmt: skip
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(self._compile(key))
            except BaseException as exc:  # handed to the waiting caller
                result.append(exc)

        worker = threading.Thread(target=run, name="grammar-compile", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            self._overdue = worker
            raise ValueError(f"the {key[0].replace('_', ' ')} is too complex: it did not compile within "
                             f"{self.timeout:g} s")  # fmt: skip
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _compile(self, key: GrammarKey) -> Any:
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
