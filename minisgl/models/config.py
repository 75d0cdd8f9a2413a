"""The model facts the engine needs, read from an HF-style config.json (no torch here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.models.config_deepseek import (
    DEEPSEEK_ARCHITECTURES,
    DeepseekConfig,
    deepseek_config,
    parse_deepseek,
)
from minisgl.models.config_families import family_config, family_fields, parse_rope
from minisgl.models.quant_config import Mxfp4Scheme, QuantScheme, parse_quant_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    *DEEPSEEK_ARCHITECTURES,
    "GptOssForCausalLM",
)
# A base model's checkpoint (`Qwen3Model`: the decoder without its LM head, as embedding models
# such as Qwen3-Embedding are saved) runs on its causal LM's blocks, with no LM head.
HEADLESS_ARCHITECTURES = {arch.removesuffix("ForCausalLM") + "Model": arch
                          for arch in SUPPORTED_ARCHITECTURES if arch.endswith("ForCausalLM")}  # fmt: skip
# Families whose `sliding_window` applies unless `use_sliding_window` says otherwise.
_WINDOWED_BY_DEFAULT = (
    "MistralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "GptOssForCausalLM",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    context_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_ids: tuple[int, ...]
    bos_id: int | None
    torch_dtype: str | None
    # Mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Which layers are sparse: layer i has experts unless i is in `mlp_only_layers` or
    # (i + 1) is not a multiple of `decoder_sparse_step` (Qwen3-MoE); the others use a dense MLP.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Sliding-window attention: the window, and which layers use it ("sliding_attention" /
    # "full_attention" per layer, as transformers' `layer_types`; empty: every layer).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Family knobs (Gemma, Phi-3, Granite); defaults are the Llama block's.
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope base (no scaling)
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # False: the decoder without its LM head (a `*Model` checkpoint, or served as embeddings).
    has_lm_head: bool = True
    # DeepSeek-V2/V3's latent attention and expert gating; then `num_kv_heads` is 1 and `head_dim`
    # the latent cache's per-token width (kv_lora_rank + qk_rope_head_dim), `attn_scale` MLA's.
    deepseek: DeepseekConfig | None = None
    # GPT-OSS: learned per-head attention sinks, and its experts' clamped SwiGLU
    # ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up both sides at the limit).
    attn_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # The checkpoint's quantized weights (its `quantization_config`); None: float weights. MXFP4
    # (`Mxfp4Scheme`) is GPT-OSS's experts only.
    quantization: QuantScheme | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer_id: int) -> bool:
        step = max(1, self.decoder_sparse_step)
        return self.is_moe and layer_id not in self.mlp_only_layers and (layer_id + 1) % step == 0

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within (Mistral v0.1, Phi-3-mini-4k), or None where a
        layer is global: a request's KV behind it is never read again (`PageManager.slide`)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        if not windows or any(window is None for window in windows):
            return None
        return max(window for window in windows if window is not None)

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's original context: a prompt longer than it rotates every position with the
        long factors (`layers.rotary.long_rope_rows`); None for every other rope."""
        scaling = self.rope_scaling
        if scaling is None or scaling.get("rope_type") != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id`, or None for a global layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer_id] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer_id: int) -> tuple[float, dict[str, Any] | None]:
        """(rope base, rope scaling) of layer `layer_id`: Gemma 3's sliding layers have their own."""
        local = bool(self.layer_types) and self.layer_types[layer_id] == "sliding_attention"
        if self.rope_local_theta is not None and local:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def serving_context_len(self, max_model_len: int | None = None) -> int:
        """The context the engine serves: the model's, capped by `max_model_len`. (A sliding
        window no longer caps it: the attention backends mask by window.)"""
        limit = self.context_len
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        return limit

    @staticmethod
    def from_dict(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        headless = arch in HEADLESS_ARCHITECTURES
        arch = HEADLESS_ARCHITECTURES.get(arch, arch)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}; minisgl supports "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        top = cfg
        cfg = deepseek_config(arch, cfg) if arch in DEEPSEEK_ARCHITECTURES else family_config(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos: list[int] = []
        for source in (generation or {}, top, cfg):
            value = source.get("eos_token_id")
            if value is None:
                continue
            for tok in value if isinstance(value, list) else [value]:
                if int(tok) not in eos:
                    eos.append(int(tok))
        rope = parse_rope(arch, cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        context_len = int(cfg.get("max_position_embeddings", 4096))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in _WINDOWED_BY_DEFAULT) else None
        if sliding is not None and int(sliding) >= context_len:
            sliding = None  # a window past the context is global attention (Phi-4-mini's 262144)
        num_layers = int(cfg["num_hidden_layers"])
        layer_types = tuple(str(t) for t in cfg.get("layer_types") or ())
        if layer_types and len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        mlp_only = tuple(int(i) for i in cfg.get("mlp_only_layers") or ())
        deepseek, kv_heads = None, int(cfg.get("num_key_value_heads") or num_heads)
        if arch in DEEPSEEK_ARCHITECTURES:  # the latent cache: one "KV head" of the latent's width
            deepseek = parse_deepseek(arch, cfg, rope.scaling)
            head_dim, kv_heads = deepseek.latent_dim, 1
            mlp_only = tuple(i for i in range(num_layers) if not deepseek.is_moe_layer(i, num_experts))
        fields = family_fields(arch, cfg)
        quantization = parse_quant_config(top.get("quantization_config"))
        if isinstance(quantization, Mxfp4Scheme) and arch != "GptOssForCausalLM":
            raise ValueError(f"{arch} with mxfp4 weights: minisgl reads MXFP4 for GPT-OSS's experts only")
        if deepseek is not None:
            fields["attn_scale"] = deepseek.softmax_scale
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            context_len=context_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", is_qwen2)),
            qk_norm=arch.startswith(("Qwen3", "Gemma3")),
            eos_ids=tuple(eos),
            bos_id=cfg.get("bos_token_id"),
            torch_dtype=top.get("torch_dtype") or top.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype"),
            # transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`, DeepSeek's is n_routed_experts
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=mlp_only,
            sliding_window=int(sliding) if sliding else None,
            layer_types=layer_types,
            rope_local_theta=rope.local_theta,
            partial_rotary_factor=rope.partial_rotary_factor,
            has_lm_head=not headless,
            deepseek=deepseek,
            quantization=quantization,
            **fields,
        )

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return ModelConfig.from_dict(cfg, gen)
