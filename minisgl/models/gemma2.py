"""Gemma 2: the Llama attention with Gemma's changes around it.

- Four norms per layer (before and after attention, before and after the MLP), each Gemma's
  RMSNorm: weight stored as an offset from one, applied in fp32 (`layers.norm.GemmaRMSNorm`).
- GeGLU MLP (tanh-approximated GELU, `hidden_activation`).
- The embedding scaled by sqrt(hidden), the scale rounded to the model dtype as transformers does.
- Softmax scale query_pre_attn_scalar ** -0.5; attention scores soft-capped by
  `attn_logit_softcapping` and the final logits by `final_logit_softcapping` (cap * tanh(x / cap)).
- Sliding-window attention on every other layer (`layer_types`, derived when the config has none).
Gemma 3 (models/gemma3.py) reuses all of it.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers.norm import GemmaRMSNorm
from minisgl.models.config import ModelConfig
from minisgl.models.llama import MLP, DecoderModel, LlamaForCausalLM, SelfAttention


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(config, layer_id, norm_cls=GemmaRMSNorm)
        self.mlp = MLP(size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is residual + hidden (DecoderModel's convention).
        residual = hidden if residual is None else residual + hidden
        attn = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(residual)))
        residual = residual + attn
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual))), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return GemmaDecoderLayer(config, layer_id)

    def make_model(self, config: ModelConfig, layers: list[nn.Module]) -> DecoderModel:
        norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        return DecoderModel(
            config, layers, norm=norm, embed_multiplier=config.hidden_size**0.5, embed_multiplier_in_dtype=True
        )
