"""Granite 3.x: the Llama block scaled by four config multipliers: the embedding by
`embedding_multiplier`, each attention and MLP output by `residual_multiplier` before it joins
the residual stream, the softmax by `attention_multiplier` (its scale, instead of
head_dim ** -0.5; `ModelConfig.attn_scale`) and the logits divided by `logits_scaling`
(`LlamaForCausalLM.compute_logits`)."""

from __future__ import annotations

from torch import nn

from minisgl.models.config import ModelConfig
from minisgl.models.llama import DecoderLayer, DecoderModel, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.residual_multiplier = config.residual_multiplier

    def can_fold_norms(self) -> bool:
        return False  # forward_folded has no multipliers


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return GraniteDecoderLayer(config, layer_id)

    def make_model(self, config: ModelConfig, layers: list[nn.Module]) -> DecoderModel:
        return DecoderModel(config, layers, embed_multiplier=config.embedding_multiplier)
