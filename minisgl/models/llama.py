"""Llama family decoder (SmolLM2, Llama 2/3.x). Qwen2, Qwen3, Mistral and the other families
(Gemma, Phi-3, Granite, OLMo 2) reuse these blocks.

Checkpoint names follow Hugging Face; `stacked_params` maps the separate q/k/v and gate/up
checkpoint tensors onto the fused projections.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import AttnLayerSpec
from minisgl.distributed import get_tp_info
from minisgl.layers.activation import make_act_and_mul
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig


class SelfAttention(nn.Module):
    """q/k/v projection, optional per-head q/k norm (`norm_cls`: Qwen3's RMSNorm or Gemma 3's),
    rotary with the layer's base and scaling, and attention with the layer's window and soft-cap
    (all read from the config)."""

    def __init__(self, config: ModelConfig, layer_id: int, norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.attention_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        theta, scaling = config.layer_rope(layer_id)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.context_len, theta, scaling, rotary_dim=config.rotary_dim
        )
        # Qwen3 and Gemma 3 normalise each head of q and k before rotary.
        self.q_norm = norm_cls(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_cls(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        spec = AttnLayerSpec(config.layer_window(layer_id), config.attn_logit_softcap)
        self.attn = AttentionLayer(layer_id, self.num_heads, self.num_kv_heads, config.head_dim, spec)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, hidden))

    def attend(
        self, positions: torch.Tensor, hidden: torch.Tensor, row_norm: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        """Attention output before o_proj: [T, Hq * D]. `row_norm` = (hidden rows, eps): `hidden`
        is the un-normalised residual stream and qkv_proj has the input norm's weight folded in
        (`DecoderLayer.fold_norms`); the rotary kernel applies the norm's 1 / rms."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        # [T, Hq + 2 Hkv, D] views of the fused output: one view and one split (~3 aten calls
        # fewer per layer than splitting the flat rows and viewing each part).
        qkv = self.qkv_proj(hidden).view(-1, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        norms = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        if norms is not None and not isinstance(norms[0], RMSNorm):  # Gemma 3's: not in the fused kernels
            q, k = norms[0](q), norms[1](k)
            norms = None
        rotary, attn = self.rotary, self.attn
        store = attn.kv_store() if rotary.stores_kv else None
        if store is not None:  # one kernel for the q/k norms, rotary and the KV store
            return attn(rotary.forward_store(positions, q, k, v, store, norms, row_norm))
        assert row_norm is None, "folded norms need the rotary kernel that stores k/v (Triton backend)"
        if norms is not None:
            q, k = rotary.forward_qk_norm(positions, q, k, *norms)
        else:
            q, k = rotary(positions, q, k)
        return attn(q, k, v)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = make_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class PreNormLayer(nn.Module):
    """A pre-norm decoder layer on the residual stream as `DecoderModel` carries it: subclasses set
    `self_attn`, `mlp`, `input_layernorm` and `post_attention_layernorm` (Llama's, GPT-OSS's,
    DeepSeek's, Granite's). `residual_multiplier` (Granite): each branch's output is scaled by it
    before it joins the residual stream."""

    residual_multiplier: float | None = None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._scaled(self.self_attn(positions, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_multiplier is None else branch * self.residual_multiplier


class DecoderLayer(PreNormLayer):
    def __init__(self, config: ModelConfig, layer_id: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_id)
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def can_fold_norms(self) -> bool:
        """Whether `fold_norms` applies: a dense MLP, no projection biases, float qkv / gate_up
        weights (not held packed by a weight fn: 4-bit, GGUF), and the Triton kernels that finish
        the norms (rotary storing k/v, SiLU)."""
        attn, mlp = self.self_attn, self.mlp
        return (
            isinstance(mlp, MLP)
            and all(p.bias is None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            and not (attn.qkv_proj.weight_held_by_fn or mlp.gate_up_proj.weight_held_by_fn)  # no float weight to fold into
            and attn.rotary.stores_kv
            and getattr(mlp.act, "impl", None) == "triton"
        )

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Fold the two RMSNorm weights into the projections they feed (qkv, gate_up: each input
        column times its norm weight), for `forward_folded`. Irreversible: the plain `forward`
        must not run afterwards."""
        for proj, norm in (
            (self.self_attn.qkv_proj, self.input_layernorm),
            (self.mlp.gate_up_proj, self.post_attention_layernorm),
        ):
            weight = proj.weight
            weight.copy_((weight.float() * norm.weight.float()).to(weight.dtype))

    def forward_folded(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer on the residual stream `hidden` [T, H] after `fold_norms`; returns the next
        residual stream (`hidden`, updated in place). No norm kernels: the projections take the
        un-normalised rows and the kernels after them (rotary, SiLU) apply each row's 1 / rms;
        o_proj and down_proj add their output to the residual in the GEMM itself. 7 kernels a
        layer instead of 9."""
        attn = self.self_attn.attend(positions, hidden, row_norm=(hidden, self.input_layernorm.eps))
        # In place, in the GEMM's epilogue (layers/linear.py: RowParallelLinear.add_to_).
        self.self_attn.o_proj.add_to_(hidden, attn)
        act = self.mlp.act(self.mlp.gate_up_proj(hidden), row_norm=(hidden, self.post_attention_layernorm.eps))
        return self.mlp.down_proj.add_to_(hidden, act)



class DecoderModel(nn.Module):
    """Embedding, layers and final norm. Layers take and return (hidden, residual): the residual
    stream is hidden + residual (hidden alone before the first layer), so the final norm adds
    them. `norm` replaces the final RMSNorm (Gemma's); the embedding is multiplied by
    `embed_multiplier` (Granite's), or by that scale cast to the model dtype first (Gemma's
    sqrt(hidden), as transformers rounds it) with `embed_multiplier_in_dtype`."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        norm: nn.Module | None = None,
        embed_multiplier: float = 1.0,
        embed_multiplier_in_dtype: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm if norm is not None else RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_multiplier = embed_multiplier
        self.embed_multiplier_in_dtype = embed_multiplier_in_dtype
        self.norms_folded = False  # set by LlamaForCausalLM.fold_norms

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_multiplier_in_dtype:
            # The multiplier rounded to the activations' dtype first (Gemma's normalizer), as a
            # host scalar: a device tensor made here would be a host copy inside a CUDA graph.
            return hidden * _in_dtype(self.embed_multiplier, hidden.dtype)
        if self.embed_multiplier != 1.0:
            return hidden * self.embed_multiplier
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        if self.norms_folded:
            for layer in self.layers:
                hidden = layer.forward_folded(positions, hidden)
            return self.norm(hidden)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint suffix -> (fused parameter suffix, part)
    stacked_params: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_info()
        self.model = self.make_model(config, [self.make_layer(config, i) for i in range(config.num_layers)])
        # None without an LM head (an embedding model: `forward`'s hidden states are its output).
        self.lm_head: ParallelLMHead | None = None
        if config.has_lm_head:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id)

    def make_model(self, config: ModelConfig, layers: list[nn.Module]) -> DecoderModel:
        return DecoderModel(config, layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of every input token: [T, hidden]."""
        return self.model(input_ids, positions)

    def fold_norms(self) -> bool:
        """Fold every layer's RMSNorm weights into its projections and run `forward_folded` from
        now on, when every layer allows it (`DecoderLayer.can_fold_norms`; one rank: o_proj and
        down_proj add the residual themselves, which a TP all-reduce would repeat). Returns
        whether it did."""
        layers = list(self.model.layers)
        if self.tp.size != 1 or not all(isinstance(layer, DecoderLayer) and layer.can_fold_norms() for layer in layers):
            return False
        for layer in layers:
            layer.fold_norms()
        self.model.norms_folded = True
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary; divided by Granite's `logits_scaling`, soft-capped by
        Gemma 2's `final_logit_softcap` (cap * tanh(logits / cap))."""
        assert self.lm_head is not None, "a model without an LM head computes no logits"
        logits = self.lm_head.logits(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


_ROUNDED: dict[tuple[float, torch.dtype], float] = {}


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (and back to a Python float), cached."""
    key = (value, dtype)
    if key not in _ROUNDED:
        _ROUNDED[key] = torch.tensor(value, dtype=dtype).item()
    return _ROUNDED[key]
