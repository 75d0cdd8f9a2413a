"""Per-family config reading for `ModelConfig.from_dict` (plain dicts, no torch): transformers'
defaults for the keys a family's hub configs leave out, the rope settings in every spelling
transformers has saved them in, and the Gemma / Phi-3 / Granite knobs."""

from __future__ import annotations

from typing import Any, NamedTuple

# What transformers' config classes assume when a key is missing (hub configs rely on these).
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "tie_word_embeddings": True,
    "head_dim": 256,
}
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
_GEMMA3_THETA = {"global": 1_000_000.0, "local": 10_000.0}
SLIDING, FULL = "sliding_attention", "full_attention"


def family_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config with the family's defaults filled in: Gemma 3's multimodal
    checkpoints nest it under `text_config`; Gemma's layer pattern is derived when absent."""
    if arch == "Gemma3ForConditionalGeneration":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("Gemma3ForConditionalGeneration config has no text_config")
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), **text}
    if arch.startswith("Gemma3"):
        cfg = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}}
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("bidirectional Gemma 3 (an embedding model) is not a causal LM minisgl serves")
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        cfg.setdefault("layer_types", None)
        if not cfg["layer_types"]:
            cfg["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(int(cfg["num_hidden_layers"]))]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and not cfg.get("layer_types"):
        # transformers: the window applies from layer `max_window_layers` on
        first = int(cfg.get("max_window_layers", 0) or 0)
        cfg = {**cfg, "layer_types": [SLIDING if i >= first else FULL for i in range(int(cfg["num_hidden_layers"]))]}
    elif arch == "GptOssForCausalLM":
        cfg = _gpt_oss_config(cfg)
    elif arch == "Gemma2ForCausalLM":
        cfg = {**_GEMMA2_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}}
        if not cfg.get("layer_types"):
            cfg["layer_types"] = [SLIDING if (i + 1) % 2 else FULL for i in range(int(cfg["num_hidden_layers"]))]
    return cfg


# transformers' GptOssConfig defaults (YaRN x32 over a 4k pretraining context, base 150000).
_GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}  # fmt: skip


def _gpt_oss_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS: every layer is sparse, its experts `intermediate_size` wide; sliding and full
    layers alternate (sliding first) unless `layer_types` says otherwise."""
    cfg = {"sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4, **cfg}
    cfg["moe_intermediate_size"] = cfg.get("intermediate_size", 2880)
    cfg["num_experts_per_tok"] = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4
    cfg["norm_topk_prob"] = True  # softmax over the top-k logits
    if not cfg.get("layer_types"):
        cfg["layer_types"] = [SLIDING if (i + 1) % 2 else FULL for i in range(int(cfg["num_hidden_layers"]))]
    if cfg.get("rope_scaling") is None and cfg.get("rope_parameters") is None:
        cfg["rope_parameters"] = dict(_GPT_OSS_ROPE)
    params = cfg.get("rope_parameters")
    if not cfg.get("rope_theta") and not (isinstance(params, dict) and params.get("rope_theta")):
        cfg["rope_theta"] = 150000.0
    return cfg


class RopeSettings(NamedTuple):
    theta: float
    scaling: dict[str, Any] | None  # None: plain rope; else with a normalised "rope_type"
    local_theta: float | None  # Gemma 3's sliding layers
    partial_rotary_factor: float


def _scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(params, dict):
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    return {**params, "rope_type": "longrope" if kind == "su" else kind}


def parse_rope(arch: str, cfg: dict[str, Any]) -> RopeSettings:
    """Rope base and scaling from `rope_theta` / `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5: flat, or per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    local_theta = cfg.get("rope_local_base_freq")
    scaling = cfg.get("rope_scaling")
    partial = cfg.get("partial_rotary_factor")
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):  # per layer type
        full, local = params[FULL], params.get(SLIDING) or {}
        theta = theta or full.get("rope_theta")
        local_theta = local_theta or local.get("rope_theta")
        scaling = scaling if scaling is not None else _scaling(full)
        if _scaling(local) is not None:
            raise ValueError(f"rope scaling on sliding layers is not supported: {local}")
    elif isinstance(params, dict):
        theta = theta or params.get("rope_theta")
        partial = partial if partial is not None else params.get("partial_rotary_factor")
        if scaling is None:
            scaling = params
    if arch.startswith("Gemma3"):
        theta = theta or _GEMMA3_THETA["global"]
        local_theta = local_theta or _GEMMA3_THETA["local"]
    scaling = _scaling(scaling)
    if scaling is not None:
        scaling.pop("rope_theta", None)
        scaling.pop("partial_rotary_factor", None)
    if scaling is not None and scaling["rope_type"] == "longrope":
        scaling = _longrope(cfg, scaling)
    if scaling is not None and scaling["rope_type"] == "yarn" and not scaling.get("factor"):
        # transformers: the served context over the pretraining one
        original = scaling.get("original_max_position_embeddings")
        if not original:
            raise ValueError("yarn rope_scaling needs original_max_position_embeddings")
        scaling["factor"] = int(cfg.get("max_position_embeddings", original)) / int(original)
    return RopeSettings(
        float(theta or 10000.0), scaling, float(local_theta) if local_theta else None, float(partial or 1.0)
    )


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE: the pretraining length (top level in transformers-4 configs) and the
    factor (transformers: max_position_embeddings over it when not given)."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope rope_scaling needs original_max_position_embeddings")
    if "short_factor" not in scaling or "long_factor" not in scaling:
        raise ValueError("longrope rope_scaling needs short_factor and long_factor")
    factor = scaling.get("factor") or int(cfg.get("max_position_embeddings", original)) / int(original)
    return {**scaling, "original_max_position_embeddings": int(original), "factor": float(factor)}


def family_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` knobs a family sets beyond the Llama block's."""
    fields: dict[str, Any] = {"hidden_act": str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")}
    if arch.startswith("Gemma"):
        fields["attn_scale"] = float(cfg["query_pre_attn_scalar"]) ** -0.5
        for key, name in (("attn_logit_softcapping", "attn_logit_softcap"), ("final_logit_softcapping", "final_logit_softcap")):
            if cfg.get(key):
                fields[name] = float(cfg[key])
    if arch == "GptOssForCausalLM":
        fields["attn_sinks"] = True
        fields["swiglu_limit"] = float(cfg.get("swiglu_limit", 7.0))
        fields["swiglu_alpha"] = float(cfg.get("swiglu_alpha", 1.702))
    if arch == "GraniteForCausalLM":
        fields["attn_scale"] = float(cfg.get("attention_multiplier", 1.0))
        fields["embedding_multiplier"] = float(cfg.get("embedding_multiplier", 1.0))
        fields["residual_multiplier"] = float(cfg.get("residual_multiplier", 1.0))
        fields["logits_scaling"] = float(cfg.get("logits_scaling", 1.0))
    return fields
