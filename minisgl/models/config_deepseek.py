"""DeepSeek-V2/V3 config facts (plain dicts, no torch): multi-head latent attention and the routed
experts' gating, read from an HF config.json with transformers' defaults for missing keys."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

# transformers' DeepseekV2Config / DeepseekV3Config defaults for the keys read here.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": {
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "n_group": None, "topk_group": None,
        "topk_method": "greedy", "routed_scaling_factor": 1.0, "norm_topk_prob": False, "first_k_dense_replace": 0,
        "moe_intermediate_size": 1407, "scoring_func": "softmax",
    },
    "DeepseekV3ForCausalLM": {
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "topk_method": "noaux_tc", "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
        "moe_intermediate_size": 2048, "scoring_func": "sigmoid", "num_experts_per_tok": 8,
    },
}  # fmt: skip


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekConfig:
    """MLA shapes and MoE gating of a DeepSeek-V2/V3 model.

    The latent cache holds per token and layer `kv_lora_rank` normalised latent values plus the
    `qk_rope_head_dim` rotated shared key: `latent_dim` values (ModelConfig sees it as one KV head
    of that size)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope dims stored as (x0, x1), (x2, x3) pairs (V2 always; V3 by default)
    softmax_scale: float  # qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under yarn
    n_shared_experts: int
    n_group: int
    topk_group: int
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"]
    scoring_func: Literal["softmax", "sigmoid"]
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int

    def __post_init__(self) -> None:
        if self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA needs kv_lora_rank > 0 and an even qk_rope_head_dim > 0, got {self}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int, num_experts: int) -> bool:
        """DeepSeek's layout: the first `first_k_dense_replace` layers dense, then every
        `moe_layer_freq`-th layer routed."""
        return num_experts > 0 and layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0


def deepseek_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with transformers' defaults filled in for keys the checkpoint leaves out."""
    return {**_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None or k in ("q_lora_rank",)}}


def parse_deepseek(arch: str, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> DeepseekConfig:
    """`cfg` with defaults (`deepseek_config`); `rope_scaling` as `parse_rope` normalised it."""
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        factor = float(rope_scaling["factor"])
        scale *= yarn_mscale(factor, float(rope_scaling["mscale_all_dim"])) ** 2
    v3 = arch == "DeepseekV3ForCausalLM"
    method = str(cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"))
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unsupported DeepSeek topk_method {method!r}")
    scoring = str(cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported DeepSeek scoring_func {scoring!r}")
    q_lora = cfg.get("q_lora_rank")
    return DeepseekConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        softmax_scale=scale,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        topk_method=method,  # type: ignore[arg-type]
        scoring_func=scoring,  # type: ignore[arg-type]
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
    )
