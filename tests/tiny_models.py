"""Tiny random-weight Hugging Face checkpoints (2-4 layers, GQA) for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
# Issue 22's families (tests/golden/test_families.py), each with a small sliding window where the
# family has one, so the parity prompts run past it.
FAMILY_ARCHS = ("gemma2", "gemma3", "gemma3_mm", "phi3", "granite", "olmo2", "mistral_sw")
WINDOW = 16


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
    elif arch in FAMILY_ARCHS:
        config, cls = _family_config(tf, arch, common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    gemma = arch.startswith("gemma")
    with torch.no_grad():  # HF starts RMSNorm weights at one: make them matter (folded norms)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma stores the offset from one (wider: its tiny models repeat a token otherwise)
                param.normal_(0.0, 1.0) if gemma else param.normal_(1.0, 0.2)
    if arch == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


def _family_config(tf, arch: str, common: dict) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    """Tiny configs from transformers' own config classes: GQA, a 16-token window, and each
    family's knobs set away from their neutral values."""
    if arch.startswith("gemma"):  # a smaller init: with sqrt(hidden) on the embedding, greedy repeats otherwise
        common = {**common, "initializer_range": 0.05}
    if arch == "gemma2":
        # Low soft-caps so the tanh bends the scores and logits; query_pre_attn_scalar != head_dim.
        config = tf.Gemma2Config(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                 attn_logit_softcapping=4.0, final_logit_softcapping=8.0, tie_word_embeddings=False,
                                 **common)  # fmt: skip
        return config, tf.Gemma2ForCausalLM
    if arch in ("gemma3", "gemma3_mm"):
        # Pattern 3: layers 0, 1 sliding, 2 global, 3 sliding; linear rope scaling on the global one.
        text = tf.Gemma3TextConfig(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
                                   sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                   **common)  # fmt: skip
        if arch == "gemma3":
            return text, tf.Gemma3ForCausalLM
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14)  # fmt: skip
        config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                 image_token_index=511, boi_token_index=509, eoi_token_index=510)  # fmt: skip
        return config, tf.Gemma3ForConditionalGeneration
    if arch == "phi3":
        # Partial rotary (8 of 16 dims) and LongRoPE. The parity prompts stay within
        # original_max_position_embeddings; prompts and decodes past it are
        # tests/golden/test_longrope.py's.
        rope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 5.0, 8.0]}
        config = tf.Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.5, original_max_position_embeddings=128,
                               rope_scaling=rope, sliding_window=WINDOW + 8, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, **common)  # fmt: skip
        return config, tf.Phi3ForCausalLM
    if arch == "granite":
        config = tf.GraniteConfig(num_hidden_layers=2, embedding_multiplier=6.0, residual_multiplier=0.4,
                                  attention_multiplier=0.1, logits_scaling=3.0, **common)  # fmt: skip
        return config, tf.GraniteForCausalLM
    if arch == "olmo2":
        return tf.Olmo2Config(num_hidden_layers=3, pad_token_id=0, eos_token_id=2, **common), tf.Olmo2ForCausalLM
    if arch == "mistral_sw":
        config = tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False, **common)
        return config, tf.MistralForCausalLM
    raise ValueError(arch)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
