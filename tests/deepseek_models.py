"""Tiny random-weight DeepSeek-V2/V3 Hugging Face checkpoints for the MLA parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VARIANTS = ("v2", "v3", "v3_no_interleave")
VOCAB = 512
# YaRN with different mscale and mscale_all_dim: a cos/sin factor other than one, and the softmax
# scale's mscale_all_dim correction, both in play.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.9,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def make_tiny_deepseek(variant: str, path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build, save and return a tiny HF DeepSeek in fp32: 3 layers (layer 0 dense, 1-2 MoE with
    8 experts in 4 groups, top-2 from 2 groups, one shared expert), 4 heads, kv_lora_rank 32,
    rope dim 8. V2: q without its low-rank path, softmax gate limited by group; V3: q_lora_rank
    48, sigmoid gate with a random correction bias. Norm weights are random around one and the
    init larger than HF's, so a misapplied weight shows and greedy does not collapse."""
    import transformers as tf

    options: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_group=4, topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=512,
        initializer_range=0.15, rms_norm_eps=1e-6, rope_scaling=dict(YARN), tie_word_embeddings=False,
    )  # fmt: skip
    if variant == "v2":
        options.update(q_lora_rank=None, topk_method="group_limited_greedy")
        config_cls, model_cls = tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM
    elif variant in ("v3", "v3_no_interleave"):
        options.update(q_lora_rank=48, rope_interleave=variant == "v3")
        config_cls, model_cls = tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(variant)
    options.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**options)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model
