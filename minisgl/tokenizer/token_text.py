"""One token id -> (its text, its exact bytes), for logprobs.

A token need not be valid UTF-8 on its own (byte-level BPE splits characters), so the bytes are
recovered from the vocabulary entry, not from decoding: byte-level vocabularies map every byte to
a printable character (GPT-2's table), SentencePiece ones spell bytes as `<0xNN>` and spaces as
`▁`. The text is those bytes decoded with U+FFFD for an incomplete character (what vLLM shows).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from minisgl.message.frontend import TokenLogprob, TopLogprob

TokenText = Callable[[int], tuple[str, bytes]]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def fast_token_text(tokenizer: Any) -> TokenText:
    """For a `tokenizers.Tokenizer` (the Rust one)."""
    spec = json.loads(tokenizer.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    added = {int(t["id"]): str(t["content"]) for t in spec.get("added_tokens", [])}
    table = _unicode_to_byte()

    @lru_cache(maxsize=1 << 16)
    def text_of(token_id: int) -> tuple[str, bytes]:
        piece = tokenizer.id_to_token(token_id)
        if piece is None:
            return "", b""
        if token_id in added:
            raw = added[token_id].encode()
        elif byte_level and all(ch in table for ch in piece):
            raw = bytes(table[ch] for ch in piece)
        else:
            raw = _piece_bytes(piece)
        return raw.decode("utf-8", errors="replace"), raw

    return text_of


def _piece_bytes(piece: str) -> bytes:
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


def slow_token_text(tokenizer: Any) -> TokenText:
    """For a transformers tokenizer without a tokenizer.json (SentencePiece models)."""

    @lru_cache(maxsize=1 << 16)
    def text_of(token_id: int) -> tuple[str, bytes]:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", b""
        raw = _piece_bytes(str(piece))
        return raw.decode("utf-8", errors="replace"), raw

    return text_of


def joined_text(text_of: TokenText, token_ids: list[int]) -> str:
    """The text of `token_ids` with special tokens kept (`<|endoftext|>` reads as itself): what
    vLLM, SGLang and llama.cpp echo for a token-id prompt. Characters split across tokens are
    joined from their bytes."""
    return b"".join(text_of(t)[1] for t in token_ids).decode("utf-8", errors="replace")


def logprob_entries(text_of: TokenText, token_ids: list[int], raw: list[Any]) -> list[TokenLogprob]:
    """Scheduler logprobs `[(logprob | None, [(id, logprob)])]`, aligned with `token_ids`, -> wire
    entries with token texts."""
    entries: list[TokenLogprob] = []
    for token_id, (logprob, top) in zip(token_ids, raw):
        text, data = text_of(token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt_text, alt_data = text_of(int(alt_id))
            alternatives.append(TopLogprob(int(alt_id), alt_text, alt_data, float(alt_logprob)))
        entries.append(TokenLogprob(token_id, text, data, None if logprob is None else float(logprob), alternatives))
    return entries
