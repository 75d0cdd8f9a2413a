"""The model facts the engine needs, read from an HF-style config.json (no torch here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


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
    sliding_window: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer_id: int) -> bool:
        step = max(1, self.decoder_sparse_step)
        return self.is_moe and layer_id not in self.mlp_only_layers and (layer_id + 1) % step == 0

    def serving_context_len(self, max_model_len: int | None = None) -> int:
        """The context the engine serves: sliding-window attention is not implemented, so the
        window (when smaller) caps it, keeping results exact; `max_model_len` caps it further."""
        limit = self.context_len
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        return limit

    @staticmethod
    def from_dict(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}; minisgl supports "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos: list[int] = []
        for source in (generation or {}, cfg):
            value = source.get("eos_token_id")
            if value is None:
                continue
            for tok in value if isinstance(value, list) else [value]:
                if int(tok) not in eos:
                    eos.append(int(tok))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 may fold rope_theta into rope_parameters
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = params
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            context_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", is_qwen2)),
            qk_norm=arch.startswith("Qwen3"),
            eos_ids=tuple(eos),
            bos_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            # transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            sliding_window=int(sliding) if sliding else None,
        )

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return ModelConfig.from_dict(cfg, gen)
