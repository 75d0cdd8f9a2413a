"""tokenizer.json + tokenizer_config.json rebuilt from a GGUF's `tokenizer.*` metadata.

Byte-level BPE ("gpt2") is built here; other tokenizer models are delegated to transformers.
A GGUF carries the vocabulary, merges, token types and special ids, but not the normalizer /
pre-tokenizer pipeline: llama.cpp names that pipeline with `tokenizer.ggml.pre`, and we map the
name back to the split rules the vocabulary was trained with.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from minisgl.models.errors import ModelSourceError
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp pre-tokenizer name -> how its text is split before BPE.
#  "gpt2": the GPT-2 regex that tokenizers' ByteLevel applies itself.
#  "gpt2+digits": every digit on its own first (StarCoder / SmolLM vocabularies have no digit merges).
#  anything else: a regex applied with Split, then ByteLevel without its own regex.
_PRE_SPLITS: dict[str, str] = {
    "gpt-2": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "smollm": "gpt2+digits", "starcoder": "gpt2+digits", "refact": "gpt2+digits",
    "codeshell": "gpt2+digits", "command-r": "gpt2+digits", "exaone": "gpt2+digits",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}  # fmt: skip
# llama.cpp matches whole pre-tokens against the vocabulary before merging for these (as the
# original Llama 3 tokenizer.json does with ignore_merges).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx", "pixtral"}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_spelling(token: str) -> str:
    table = byte_alphabet()
    return "".join(table[byte] for byte in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    split = _PRE_SPLITS.get(pre)
    if split is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with the GPT-2 rules", pre)
        split = "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.startswith("gpt2"))
    if split == "gpt2":
        return byte_level
    if split == "gpt2+digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def build_bpe_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` for `tokenizer.ggml.model == "gpt2"` (byte-level BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ModelSourceError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    alphabet = set(byte_alphabet().values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # Regular tokens are already in the byte alphabet; user-defined ones are stored as raw text.
        key = token if set(token) <= alphabet else _byte_level_spelling(token)
        vocab.setdefault(key, index)
    merges = [tuple(merge.split(" ", 1)) for merge in merges_raw]
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    if meta.get("tokenizer.ggml.add_space_prefix"):
        logger.warning("GGUF asks for a space prefix on a byte-level tokenizer; ignoring it like llama.cpp does")

    # Control tokens must stay whole and be skippable on decode; a "control" token written outside
    # the byte alphabet is a llama.cpp labelling mistake with no vocab entry, so it is left out.
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(special)
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types)
        if kind == _USER_DEFINED and token in vocab
    ]
    tokenizer.add_tokens(user)

    template_single, template_pair, specials = "$A", "$A $B:1", []
    for flag, name, before in (("add_bos_token", "bos", True), ("add_eos_token", "eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if meta.get(f"tokenizer.ggml.{flag}") and token_id is not None:
            text = tokens[int(token_id)]
            specials.append((text, int(token_id)))
            if before:
                template_single, template_pair = f"{text} {template_single}", f"{text} {template_pair}"
            else:
                template_single, template_pair = f"{template_single} {text}", f"{template_pair} {text}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template_single, pair=template_pair, special_tokens=specials
    )
    return tokenizer


def tokenizer_config(meta: dict[str, Any], model_max_length: int) -> dict[str, Any]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token_text(name: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        return None if token_id is None else tokens[int(token_id)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text("bos"),
        "eos_token": token_text("eos"),
        "pad_token": token_text("padding"),
        "unk_token": token_text("unknown"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer_files(meta: dict[str, Any], out_dir: Path, model_max_length: int, gguf_path: Path) -> None:
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelSourceError("GGUF has no tokenizer.ggml.tokens; it carries no tokenizer")
    if kind != "gpt2":
        _write_with_transformers(str(kind), gguf_path, out_dir, model_max_length)
        return
    build_bpe_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(meta, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _write_with_transformers(kind: str, gguf_path: Path, out_dir: Path, model_max_length: int) -> None:
    """Sentencepiece-style vocabularies ("llama", "t5", ...) go through transformers' GGUF tokenizer
    builder: rebuilding merges from piece scores is its own project, and transformers already
    does it; only byte-level BPE is built here."""
    from transformers import AutoTokenizer

    logger.info("building the %r GGUF tokenizer with transformers", kind)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSourceError(f"cannot build the {kind!r} tokenizer of {gguf_path.name}: {reason}") from exc
    tokenizer.model_max_length = model_max_length
    tokenizer.save_pretrained(str(out_dir))
