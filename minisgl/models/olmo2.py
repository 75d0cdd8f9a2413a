"""OLMo 2: no norm before attention or the MLP; an RMSNorm after each instead (applied to the
sublayer's output before it joins the residual stream), and RMSNorm on q and k over the whole
projection (all heads at once) before rotary.

With tensor parallelism each rank holds a slice of q and k, so the q/k norms all-reduce the sum
of squares (counted once per key/value head where heads are replicated) and scale by their
slice of the weight. The norms follow transformers' Olmo2RMSNorm rounding (weight times the fp32
normalised rows, then the cast)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers.norm import TorchNorm
from minisgl.models.config import ModelConfig
from minisgl.models.llama import MLP, DecoderModel, LlamaForCausalLM, SelfAttention


class Olmo2RMSNorm(TorchNorm):
    """RMSNorm over `size` features, of which this rank holds slice `shard` of `num_shards`
    (each shard held by `replicas` ranks); the default is the whole vector on every rank."""

    def __init__(self, size: int, eps: float, num_shards: int = 1, shard: int = 0, replicas: int = 1) -> None:
        super().__init__()
        self.eps = eps
        self.size = size
        self.local = size // num_shards
        self.shard, self.num_shards, self.replicas = shard, num_shards, replicas
        self.weight = nn.Parameter(torch.ones(self.local))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.size,):
            raise ValueError(f"norm weight shape {tuple(loaded.shape)} != ({self.size},)")
        param.data.copy_(loaded.narrow(0, self.shard * self.local, self.local))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.num_shards == 1:
            variance = x32.pow(2).mean(-1, keepdim=True)
        else:
            variance = all_reduce(x32.pow(2).sum(-1, keepdim=True)) / (self.replicas * self.size)
        return (self.weight * (x32 * torch.rsqrt(variance + self.eps))).to(x.dtype)


class Olmo2Attention(SelfAttention):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        tp, qkv = get_tp_info(), self.qkv_proj
        eps, dim = config.rms_norm_eps, config.head_dim
        self.q_norm = Olmo2RMSNorm(config.num_heads * dim, eps, tp.size, tp.rank)  # type: ignore[assignment]
        kv_shards = tp.size // qkv.kv_replicas
        self.k_norm = Olmo2RMSNorm(  # type: ignore[assignment]
            self.num_kv_heads * kv_shards * dim, eps, kv_shards, tp.rank // qkv.kv_replicas, qkv.kv_replicas
        )

    def attend(
        self, positions: torch.Tensor, hidden: torch.Tensor, row_norm: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        assert row_norm is None, "OLMo 2 has no input norm to fold"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)  # type: ignore[misc]
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)  # type: ignore[misc]
        q, k = self.rotary(positions, q, k)
        return self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_id)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is residual + hidden (DecoderModel's convention).
        residual = hidden if residual is None else residual + hidden
        residual = residual + self.post_attention_layernorm(self.self_attn(positions, residual))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_id)

    def make_model(self, config: ModelConfig, layers: list[nn.Module]) -> DecoderModel:
        return DecoderModel(config, layers, norm=Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps))
