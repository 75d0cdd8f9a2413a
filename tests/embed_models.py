"""Tiny random-weight decoder embedding checkpoints (Qwen3-Embedding style) and their reference.

`make_tiny_embedder` saves a `Qwen3Model` (the decoder without its LM head; tensors named without
the `model.` prefix, as Qwen3-Embedding ships them) with sentence-transformers files: a Transformer
module, last-token Pooling and Normalize. `reference_embeddings` is transformers' own forward with
the same pooling: the last token's final hidden state, L2-normalized.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_tiny_embedder(path: Path, vocab_size: int = 512, matryoshka: bool = True, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    config = tf.Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                            initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    model = tf.Qwen3Model(config).eval()
    with torch.no_grad():  # norm weights around one, not at one (a norm applied wrongly shows)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    model.save_pretrained(path)
    if matryoshka:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}, indent=1))
    write_sentence_transformers_files(path)
    return model


def write_sentence_transformers_files(path: Path, mode: str = "lasttoken", normalize: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=1))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    pooling = {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == mode for m in modes},
               "include_prompt": True}  # fmt: skip
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=1))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def reference_embeddings(path: Path, prompts: list[list[int]], dimensions: int | None = None) -> list[torch.Tensor]:
    """transformers' `AutoModel` (fp32): last token's final hidden state, cut, L2-normalized."""
    import transformers as tf

    model = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(hidden[:dimensions], dim=0))
    return out
