"""config.json / generation_config.json contents from GGUF metadata (HF field names)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from minisgl.models.errors import ModelSourceError
from minisgl.models.gguf_reader import ArchSpec, dequantize_tensor
from minisgl.utils.logging import get_logger

if TYPE_CHECKING:
    from gguf.gguf_reader import ReaderTensor

logger = get_logger(__name__)

_DEFAULT_CONTEXT = 4096


def _required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelSourceError(f"GGUF metadata lacks {key}; the file is incomplete or not a model")
    return meta[key]


def _token_id(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def _rows(tensors: dict[str, ReaderTensor], name: str) -> int | None:
    tensor = tensors.get(name)
    # GGUF shapes are fastest-first, so the HF "out features" dimension is the last one.
    return None if tensor is None else int(tensor.shape.tolist()[-1])


def build_config(
    meta: dict[str, Any], spec: ArchSpec, arch: str, tensors: dict[str, ReaderTensor]
) -> dict[str, Any]:
    n_layer = int(_required(meta, f"{arch}.block_count"))
    hidden = int(_required(meta, f"{arch}.embedding_length"))
    n_head = int(_required(meta, f"{arch}.attention.head_count"))
    n_kv_head = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    # head_dim is not always hidden/n_head (Qwen3 uses 128 at any width); the q projection's
    # output rows are the ground truth, key_length the declared value.
    q_rows = _rows(tensors, "blk.0.attn_q.weight")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or (q_rows // n_head if q_rows else hidden // n_head))
    vocab = _rows(tensors, "token_embd.weight") or len(_required(meta, "tokenizer.ggml.tokens"))
    context = meta.get(f"{arch}.context_length")
    if context is None:
        logger.warning("GGUF has no %s.context_length; assuming %d", arch, _DEFAULT_CONTEXT)
    config: dict[str, Any] = {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(f"{arch}.feed_forward_length", 0)),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, head_dim, tensors),
        "max_position_embeddings": int(context or _DEFAULT_CONTEXT),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _token_id(meta, "bos"),
        "eos_token_id": _token_id(meta, "eos"),
        "pad_token_id": _token_id(meta, "padding"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if spec.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if spec.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if spec.model_type in ("qwen3", "qwen3_moe"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if spec.model_type == "qwen3_moe":
        config.update(_moe_fields(meta, arch, tensors))
        if not config["intermediate_size"]:
            config["intermediate_size"] = config["moe_intermediate_size"]
    return config


def _moe_fields(meta: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    n_expert = int(_required(meta, f"{arch}.expert_count"))
    expert_ffn = meta.get(f"{arch}.expert_feed_forward_length") or _rows(tensors, "blk.0.ffn_gate_exps.weight")
    if any(name.endswith("_shexp.weight") for name in tensors):
        raise ModelSourceError("GGUF qwen3moe file has shared-expert tensors, which Qwen3-MoE does not define")
    return {
        "num_experts": n_expert,
        "num_experts_per_tok": int(_required(meta, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(expert_ffn or 0),
        # llama.cpp's qwen3moe graph renormalizes the top-k router weights.
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def _rope_scaling(
    meta: dict[str, Any], arch: str, head_dim: int, tensors: dict[str, ReaderTensor]
) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none"):
        raise ModelSourceError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")
    if "rope_freqs.weight" in tensors:
        base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        return _llama3_rope_scaling(tensors["rope_freqs.weight"], base, dim)
    return None


def _llama3_rope_scaling(tensor: ReaderTensor, base: float, dim: int) -> dict[str, Any]:
    """Recover Llama-3.1-style rope_scaling from the per-frequency divisors llama.cpp stores.

    llama.cpp bakes the scaling into a `rope_freqs` tensor; HF wants the parameters. Llama 3.x
    always used low/high frequency factors 1 and 4 and an original context of 8192, so we only
    solve for `factor` (the largest divisor) and check the whole curve reproduces.
    """
    stored = dequantize_tensor(tensor).reshape(-1)
    factor, low, high, original = float(stored.max()), 1.0, 4.0, 8192
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    expected = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if stored.shape[0] != len(expected) or not np.allclose(stored, expected, rtol=1e-4):
        raise ModelSourceError("GGUF rope_freqs tensor does not match Llama-3 rope scaling; cannot express it in HF config")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def build_generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    # Chat models end turns with an end-of-turn token that llama.cpp records apart from eos.
    stops: list[int] = []
    for name in ("eos", "eot", "eom"):
        token = _token_id(meta, name)
        if token is not None and token not in stops:
            stops.append(token)
    generation: dict[str, Any] = {"bos_token_id": _token_id(meta, "bos")}
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
    pad = _token_id(meta, "padding")
    if pad is not None:
        generation["pad_token_id"] = pad
    return generation
