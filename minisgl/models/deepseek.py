"""DeepSeek-V2 and DeepSeek-V3 (also Kimi K2, Moonlight): multi-head latent attention and
group-routed experts with shared experts.

Attention (layers/mla.py): q from `q_proj`, or through the low-rank `q_a_proj` -> `q_a_layernorm`
-> `q_b_proj` when `q_lora_rank` is set; `kv_a_proj_with_mqa` gives the KV latent (normalised by
`kv_a_layernorm`) and one shared rope key. Only the latent and the rotated rope key are cached
(kv_lora_rank + qk_rope_head_dim values per token and layer). The rope dims come in interleaved
pairs (V2; V3 with `rope_interleave`): they are de-interleaved (evens, then odds) and rotated
half-wise, which is Hugging Face's V3 layout; the dot products are V2's too. YaRN scaling, its
cos/sin factor and the softmax scale's mscale_all_dim correction follow transformers.

MLP: layers before `first_k_dense_replace` (and off the `moe_layer_freq` grid) are dense; the
others route to `n_routed_experts` (layers/deepseek_moe.py) and add `n_shared_experts` shared ones.

Tensor parallelism: heads are split across ranks (q_proj / q_b_proj and kv_b_proj column-parallel
by head, o_proj row-parallel); the low-rank down-projections (q_a_proj, kv_a_proj_with_mqa), their
norms and the latent cache are replicated, every rank caching the full latent (it has no head
dimension to split). Experts split their intermediate dimension as in layers/moe.py, the shared
experts as a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers.deepseek_moe import DeepseekMoE, GateSpec
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.mla import LatentAttention
from minisgl.layers.moe import expert_stacked_params
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig
from minisgl.models.config_deepseek import DeepseekConfig
from minisgl.models.llama import MLP, LlamaForCausalLM, PreNormLayer

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with its default eps


def _mla(config: ModelConfig) -> DeepseekConfig:
    if config.deepseek is None:
        raise ValueError(f"{config.architecture} needs the DeepSeek attention fields (kv_lora_rank, ...) in its config")
    return config.deepseek


class LatentSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        mla = self.mla = _mla(config)
        hidden, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        self.q_a_proj: nn.Linear | None = None
        self.q_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim)
            self.num_heads = self.q_b_proj.out_per_rank // mla.qk_head_dim
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * mla.qk_head_dim)
            self.num_heads = self.q_proj.out_per_rank // mla.qk_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=bias)
        theta, scaling = config.layer_rope(layer_id)
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, config.context_len, theta, scaling)
        self.attn = LatentAttention(
            layer_id, self.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
            mla.v_head_dim, mla.softmax_scale,
        )  # fmt: skip

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved pairs (x0, x1), (x2, x3), ... -> evens then odds (rotate-half layout)."""
        if not self.mla.rope_interleave:
            return x
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        mla, tokens = self.mla, hidden.shape[0]
        if self.q_a_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            assert self.q_proj is not None
            q = self.q_proj(hidden)
        q = q.view(tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        latent, k_rope = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope = self._rope_layout(q_rope).contiguous()
        k_rope = self._rope_layout(k_rope).contiguous().view(tokens, 1, mla.qk_rope_head_dim)
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope)
        cached = torch.cat([latent, k_rope.reshape(tokens, mla.qk_rope_head_dim)], dim=-1)
        out = self.attn(q_nope, q_rope, cached, self.kv_b_proj.weight)
        return self.o_proj(out)


class DeepseekDecoderLayer(PreNormLayer):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        mla = _mla(config)
        self.self_attn = LatentSelfAttention(config, layer_id)
        self.mlp: nn.Module
        if config.is_sparse_layer(layer_id):
            shared = None
            if mla.n_shared_experts > 0:
                shared = MLP(config.hidden_size, config.moe_intermediate_size * mla.n_shared_experts, config.hidden_act)
            gate = GateSpec(mla.scoring_func, mla.topk_method, mla.n_group, mla.topk_group,
                            mla.routed_scaling_factor, config.norm_topk_prob)  # fmt: skip
            self.mlp = DeepseekMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                   config.moe_intermediate_size, gate, shared)  # fmt: skip
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        _mla(config)
        super().__init__(config)
        # Per-expert names first: the dense `.gate_proj.` entry must not catch an expert's (nor
        # the Llama map's q_proj -> qkv_proj: MLA's q_proj is its own layer).
        self.stacked_params = {
            **expert_stacked_params(config.num_experts),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return DeepseekDecoderLayer(config, layer_id)

    def checkpoint_name(self, name: str) -> str | None:
        """Skip the layers past `num_hidden_layers`: V3's multi-token-prediction module
        (`model.layers.61.*`), which plain decoding does not run (transformers skips it too)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and int(parts[2]) >= self.config.num_layers:
            return None
        return name


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's differences are config-driven: sigmoid gate with its correction bias (`noaux_tc`),
    `rope_interleave` (ModelConfig.deepseek)."""
