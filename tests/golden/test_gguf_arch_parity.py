"""Tiny GGUFs of every supported architecture: our converted directory runs in transformers with
exactly the logits of transformers' own GGUF loader (qkv bias, q/k norms, MoE expert split)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl.models.gguf import convert_gguf
from tests.gguf_builders import tiny_model

# transformers' GGUF config mapping ignores head_dim for qwen3 and the expert width for qwen3moe,
# falling back to the HF defaults (128 and 768), so those tiny models use exactly those sizes.
SIZES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "qwen3moe": {"head_dim": 16, "ffn": 768},
}


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers needs accelerate for GGUF")
@pytest.mark.parametrize("arch", list(SIZES))
def test_tiny_arch_logits_match_hf_gguf_loader(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model(tmp_path / f"{arch}.gguf", arch, tied=arch != "qwen2", sizes=SIZES[arch])
    convert_gguf(path, tmp_path / "out")
    ours, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 70, 100, 200, 3, 261, 2]])
    with torch.no_grad():
        ours_logits, theirs_logits = ours(ids).logits, theirs(ids).logits
    assert ours_logits.abs().max() > 0
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=0)


def test_sentencepiece_tokenizer_is_delegated_to_transformers(tmp_path: Path) -> None:
    import numpy as np
    from transformers import AutoTokenizer

    from minisgl.models.gguf import open_gguf
    from tests.gguf_builders import write_gguf

    source, _ = tiny_model(tmp_path / "src.gguf", "llama")
    tensors = {t.name: np.array(t.data) for t in open_gguf(source).tensors}
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab", "▁b"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    tensors["token_embd.weight"] = np.zeros((len(tokens), 32), np.float32)
    meta = {
        "llama.block_count": 2, "llama.embedding_length": 32, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.context_length": 256,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }  # fmt: skip
    path = write_gguf(tmp_path / "spm.gguf", "llama", meta, tensors, tokenizer=False)
    convert_gguf(path, tmp_path / "out")
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["ab", "a b ab", "ba", "\u00e9"]:
        assert ours(text).input_ids == theirs(text).input_ids, text
    assert ours("ab").input_ids == [1, tokens.index("▁ab")] and ours.model_max_length == 256
