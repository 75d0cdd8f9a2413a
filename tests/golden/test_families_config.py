"""Hub-style configs of issue 22's families read into the facts the models build from (defaults
transformers assumes for missing keys, layer patterns, per-layer rope, LongRoPE), the LongRoPE
table against transformers' own rope functions. (The Triton backend runs these families' windows
and soft-caps: tests/golden/test_triton_families_cpu.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.models.config import ModelConfig

# Shaped like google/gemma-3-1b-it's config.json (transformers 4 spelling).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000, "rope_theta": 1000000, "rope_scaling": None, "sliding_window": 512,
    "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": [1, 106], "bos_token_id": 2,
}  # fmt: skip
# Shaped like google/gemma-3-4b-it's: the text config leaves most keys to transformers' defaults.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
    "eos_token_id": [1, 106],
}  # fmt: skip
# Shaped like microsoft/Phi-4-mini-instruct's.
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "hidden_act": "silu",
    "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 8 for i in range(48)],
                     "short_factor": [1.0] * 48},
}  # fmt: skip


def test_gemma3_layer_pattern_and_rope_bases() -> None:
    config = ModelConfig.from_dict(GEMMA3_1B)
    assert config.layer_types == tuple(["sliding_attention"] * 5 + ["full_attention"]) * 4 + (
        "sliding_attention", "sliding_attention",
    )  # fmt: skip
    assert [config.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert config.layer_rope(0) == (10000.0, None) and config.layer_rope(5) == (1_000_000.0, None)
    assert config.softmax_scale == 256**-0.5 and config.qk_norm and config.tie_word_embeddings
    assert config.serving_context_len() == 32768 and config.eos_ids == (1, 106)


def test_gemma3_multimodal_checkpoint_reads_its_text_config_with_defaults() -> None:
    config = ModelConfig.from_dict(GEMMA3_4B)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (8, 4, 256, 262_208)
    assert config.num_layers == 34 and config.sliding_window == 1024 and config.tie_word_embeddings
    assert config.layer_rope(5) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert config.layer_rope(0) == (10_000.0, None)


def test_gemma2_defaults_alternate_windows() -> None:
    config = ModelConfig.from_dict({
        "architectures": ["Gemma2ForCausalLM"], "hidden_size": 2304, "num_attention_heads": 8,
        "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 256000, "head_dim": 256,
        "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
    })  # fmt: skip
    assert [config.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.hidden_act == "gelu_pytorch_tanh"


def test_phi4_mini_longrope_partial_rotary_and_global_window() -> None:
    config = ModelConfig.from_dict(PHI4_MINI)
    assert config.sliding_window is None  # 262144 > the context: global attention
    assert config.rotary_dim == 96 and config.head_dim == 128
    scaling = config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096 and scaling["factor"] == 32.0
    su = ModelConfig.from_dict({**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "type": "su"}})
    assert su.rope_scaling is not None and su.rope_scaling["rope_type"] == "longrope"


def test_granite_and_mistral_knobs() -> None:
    granite = ModelConfig.from_dict({
        "architectures": ["GraniteForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100, "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 16.0,
    })  # fmt: skip
    assert granite.softmax_scale == 0.0078125 and granite.embedding_multiplier == 12.0
    assert (granite.residual_multiplier, granite.logits_scaling) == (0.22, 16.0)
    mistral = ModelConfig.from_dict({
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100, "max_position_embeddings": 32768, "sliding_window": 4096,
    })  # fmt: skip
    assert mistral.layer_window(1) == 4096 and mistral.serving_context_len() == 32768  # no longer capped


def test_qwen2_window_from_max_window_layers() -> None:
    config = ModelConfig.from_dict({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
        "vocab_size": 100, "max_position_embeddings": 128, "use_sliding_window": True, "sliding_window": 32,
        "max_window_layers": 2,
    })  # fmt: skip
    assert [config.layer_window(i) for i in range(4)] == [None, None, 32, 32]  # as transformers' layer_types


def test_longrope_table_equals_transformers() -> None:
    """Short factors below original_max_position_embeddings, long ones from there, each with
    transformers' attention factor: the cos/sin rows transformers computes for a sequence
    within, and one past, the original length."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl.layers.rotary import RotaryEmbedding

    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [3.0, 4.0, 6.0, 9.0]}
    hf_config = tf.Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5,
                              max_position_embeddings=256, original_max_position_embeddings=32, rope_scaling=rope)  # fmt: skip
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    ours = RotaryEmbedding(16, 256, config.rope_theta, config.rope_scaling, impl="torch", rotary_dim=config.rotary_dim)
    positions = torch.arange(256).float()
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = init(hf_config, None)
    long, _ = init(hf_config, None, seq_len=33)
    assert factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    for rows, inv_freq in ((slice(0, 32), short), (slice(32, 256), long)):
        angles = torch.outer(positions[rows], inv_freq)
        torch.testing.assert_close(ours.cos[rows], angles.cos() * factor, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin[rows], angles.sin() * factor, rtol=0, atol=1e-6)


def test_unsupported_architecture_lists_the_families() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'.*Gemma3ForCausalLM.*Olmo2"):
        ModelConfig.from_dict({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64,
                               "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100})  # fmt: skip
