"""Qwen3-MoE: the Qwen3 block (q/k norm) whose MLP is a routed mixture of experts.

Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP of
`intermediate_size`. Checkpoints store every expert's projections separately
(`mlp.experts.<e>.{gate,up,down}_proj.weight`); `stacked_params` maps them onto the stacked
expert weights, each rank copying only its slice of the intermediate dimension.
"""

from __future__ import annotations

from torch import nn

from minisgl.layers.moe import SparseMoeBlock, expert_stacked_params
from minisgl.models.config import ModelConfig
from minisgl.models.llama import DecoderLayer, LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if not config.is_moe or config.moe_intermediate_size <= 0:
            raise ValueError("Qwen3MoeForCausalLM needs num_experts and moe_intermediate_size in its config")
        super().__init__(config)
        # Per-expert names first: the dense `.gate_proj.` entry must not catch an expert's.
        self.stacked_params = {**expert_stacked_params(config.num_experts), **LlamaForCausalLM.stacked_params}

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if not config.is_sparse_layer(layer_id):
            return DecoderLayer(config, layer_id)
        moe = SparseMoeBlock(
            config.num_experts, config.num_experts_per_tok, config.hidden_size,
            config.moe_intermediate_size, config.norm_topk_prob,
        )  # fmt: skip
        return DecoderLayer(config, layer_id, mlp=moe)
