"""Tiny random-weight checkpoints that the server can run split over ranks: 4 attention heads,
2 key/value heads (so TP=2 splits them and TP=4 replicates them), with the embedded SmolLM2
tokenizer (hence the 49152-token vocabulary), so the server tokenizes and detokenizes as usual."""

from __future__ import annotations

import shutil
from pathlib import Path

ARCHS = ("llama", "qwen3")


def make_served_model(arch: str, path: Path, seed: int = 0) -> Path:
    import torch
    import transformers as tf

    from minisgl.models.source import resolve_model_dir

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if arch == "llama":
        config = tf.LlamaConfig(tie_word_embeddings=True, rope_theta=50000.0, **common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen3":
        config = tf.Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    cls(config).eval().save_pretrained(path)
    tokenizer_dir = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path
