"""Phi-3 / Phi-4-mini: the Llama block, with q/k/v and gate/up fused in the checkpoint
(`qkv_proj`, `gate_up_proj`), LongRoPE (`rope_scaling` longrope / su: short and long factors
around `original_max_position_embeddings`, see `layers.rotary`), partial rotary
(`partial_rotary_factor`, Phi-4-mini's 0.75) and, where the config sets it below the context,
a sliding window on every layer (Phi-3-mini-4k's 2047).

The fused checkpoint tensors are cut into their q / k / v (gate / up) parts at load time
(`fused_params`, `models/loader.py`), so every rank loads its own slice of each, as for Llama.
"""

from __future__ import annotations

from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params: dict[str, tuple[str, str | int]] = {}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        inter = config.intermediate_size
        # checkpoint suffix -> its parts along dim 0, in order: (loader part, full size)
        self.fused_params: dict[str, list[tuple[str | int, int]]] = {
            "qkv_proj": [("q", q_size), ("k", kv_size), ("v", kv_size)],
            "gate_up_proj": [(0, inter), (1, inter)],
        }
