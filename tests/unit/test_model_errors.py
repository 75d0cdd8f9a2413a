"""User mistakes in model loading give one clear ValueError, not a traceback wall."""

from __future__ import annotations

import json

import pytest

from minisgl import LLM
from minisgl.models.config import ModelConfig


def test_unsupported_architecture_in_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
    }))
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'.*LlamaForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_missing_weights(tmp_path):
    from tests.tiny_models import make_tiny_model

    make_tiny_model("llama", tmp_path)
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        LLM(str(tmp_path), device="cpu")


def test_bad_device():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        LLM(device="tpu")


def test_eos_ids_from_generation_config():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 100, "eos_token_id": 2}
    assert ModelConfig.from_dict(cfg, {"eos_token_id": [2, 7]}).eos_ids == (2, 7)
    assert ModelConfig.from_dict(cfg).eos_ids == (2,)
