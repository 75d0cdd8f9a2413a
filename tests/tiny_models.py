"""Tiny random-weight Hugging Face checkpoints (2-4 layers, GQA) for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def make_tiny_model(arch: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Build, save and return an HF model in fp32. Weights use a larger init than HF's default so
    greedy decoding does not collapse into repeating one token; the RMSNorm weights are random
    around one (HF's init is all ones, under which a norm weight applied wrongly goes unseen)."""
    import transformers as tf

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        # Tied embeddings and Llama-3 rope scaling.
        config = tf.LlamaConfig(
            num_hidden_layers=2, tie_word_embeddings=True, rope_theta=50000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common,
        )
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        config = tf.Qwen2Config(num_hidden_layers=3, tie_word_embeddings=False, **common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = tf.Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False, **common)
        cls = tf.Qwen3ForCausalLM
    elif arch == "mistral":
        config = tf.MistralConfig(num_hidden_layers=4, sliding_window=None, tie_word_embeddings=False, **common)
        cls = tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # HF starts RMSNorm weights at one: make them matter (folded norms)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    if arch == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
