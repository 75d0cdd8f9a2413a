"""GPT-OSS (openai/gpt-oss-20b, -120b): the Llama block with

- attention sinks: a learned logit per q head joins every query's softmax denominator
  (`AttnLayerSpec.sinks`, run by both attention backends);
- q/k/v and o projections with biases; sliding-window (128) and full layers alternating
  (`layer_types`); YaRN rope (layers/rotary.py);
- a routed MoE on every layer: top-k of a biased router's logits, softmaxed among themselves,
  experts with biases and the clamped SwiGLU `(up + 1) * gate * sigmoid(1.702 * gate)`
  (layers/moe_swiglu.py). The shipped checkpoints hold the experts in MXFP4 (`*_blocks`,
  `*_scales`): kept 4-bit on CUDA (the fused kernel dequantizes tiles in registers), dequantized
  at load to the model dtype elsewhere; transformers' dense layout loads too.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import AttnLayerSpec
from minisgl.distributed import get_tp_info
from minisgl.layers.linear import RowParallelLinear
from minisgl.layers.moe_swiglu import MXFP4_STACKED_PARAMS, GptOssMoeBlock
from minisgl.layers.norm import RMSNorm
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM, PreNormLayer, SelfAttention
from minisgl.models.quant_config import Mxfp4Scheme


class GptOssAttention(SelfAttention):
    """The Llama attention with an o_proj bias and this rank's slice of the per-head sinks."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, bias=True)
        self.tp_rank = get_tp_info().rank
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        spec = self.attn.spec
        self.attn.spec = AttnLayerSpec(spec.sliding_window, spec.logit_cap, sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.num_heads
        if loaded.shape[0] != size * get_tp_info().size:
            raise ValueError(f"self_attn.sinks has {loaded.shape[0]} heads, the model {size * get_tp_info().size}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class GptOssDecoderLayer(PreNormLayer):
    """Pre-norm attention and MoE, the residual stream as `DecoderModel` carries it."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_id)
        assert config.swiglu_limit is not None, "GPT-OSS configs set swiglu_limit (config_families)"
        self.mlp = GptOssMoeBlock(
            config.num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
            config.swiglu_limit, config.swiglu_alpha, mxfp4=isinstance(config.quantization, Mxfp4Scheme),
        )  # fmt: skip
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_QKV: dict[str, tuple[str, str | int]] = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                                          "v_proj": ("qkv_proj", "v")}  # fmt: skip


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if not config.is_moe or config.swiglu_limit is None:
            raise ValueError("GptOssForCausalLM needs num_local_experts and swiglu_limit in its config")
        super().__init__(config)
        # q/k/v fused. MXFP4 experts kept 4-bit load under their own names; dequantized ones through
        # the dense parameter's `blocks` / `scales` parts.
        resident = any(getattr(m, "mxfp4", False) for m in self.modules() if m is not self)
        self.stacked_params = dict(_QKV) if resident else {**_QKV, **MXFP4_STACKED_PARAMS}

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return GptOssDecoderLayer(config, layer_id)
