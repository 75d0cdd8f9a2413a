"""GPT-OSS's `quant_method: mxfp4` as a typed scheme (models/quant_config.py's `Mxfp4Scheme`), like
the FP8 and 4-bit integer formats: parsed once, carried by `ModelConfig.quantization`, asked by
the model (models/gpt_oss.py), refused for families that do not read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.models.config import ModelConfig
from minisgl.models.quant_config import Mxfp4Scheme, parse_quant_config

_GPT_OSS = {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 64}  # fmt: skip
_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


def test_mxfp4_parses_to_its_scheme() -> None:
    assert parse_quant_config(_MXFP4) == Mxfp4Scheme(ignore=("model.layers.*.self_attn", "lm_head"))
    assert parse_quant_config({"quant_method": "mxfp4"}) == Mxfp4Scheme()


def test_shipped_20b_config_carries_the_scheme() -> None:
    root = Path(__file__).resolve().parents[2]
    scheme = ModelConfig.from_dir(root / "configs" / "gpt-oss-20b").quantization
    assert isinstance(scheme, Mxfp4Scheme) and "lm_head" in scheme.ignore


def test_gpt_oss_experts_ask_the_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused kernel serves (here: the layer is told it does), the scheme alone decides
    whether the experts stay 4-bit under the checkpoint's names or load dense."""
    import torch

    import minisgl.layers.moe_swiglu as moe_swiglu
    from minisgl.models.registry import build_model

    monkeypatch.setattr(moe_swiglu, "select_moe_impl", lambda impl, device: "triton")
    for quant, packed in ((_MXFP4, True), (None, False)):
        config = ModelConfig.from_dict({**_GPT_OSS, "quantization_config": quant})
        with torch.device("meta"):
            experts = build_model(config).model.layers[0].mlp.experts
        assert experts.mxfp4 == packed
        assert hasattr(experts, "gate_up_proj_blocks") == packed and hasattr(experts, "gate_up_proj") != packed


def test_mxfp4_outside_gpt_oss_is_refused() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "quantization_config": _MXFP4}  # fmt: skip
    with pytest.raises(ValueError, match="GPT-OSS's experts only"):
        ModelConfig.from_dict(llama)
