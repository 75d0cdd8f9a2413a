"""YaRN rope (GPT-OSS, DeepSeek) equals transformers' `_compute_yarn_parameters`: the inverse
frequencies to the bit and the cos/sin factor, with and without `truncate`, DeepSeek's
`mscale` / `mscale_all_dim` ratio, an explicit `attention_factor`, and the factor derived from the
context lengths when the config leaves it out."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from minisgl.layers.rotary import _inv_freq
from minisgl.models.config import ModelConfig

CASES = [
    ({"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
     64, 150000.0),  # GPT-OSS
    ({"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096}, 64, 10000.0),  # DeepSeek-V3's rope part
    ({"factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 0.9}, 16, 10000.0),
    ({"factor": 2.0, "mscale": 0.707, "mscale_all_dim": 0.5, "original_max_position_embeddings": 2048}, 128, 5e5),
]  # fmt: skip


@pytest.mark.parametrize("params,dim,theta", CASES)
def test_yarn_matches_transformers(params: dict[str, Any], dim: int, theta: float) -> None:
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tf.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, max_position_embeddings=8192,
                            rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})  # fmt: skip
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got, factor = _inv_freq(dim, theta, {"rope_type": "yarn", **params})
    assert torch.equal(got, expected)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_yarn_factor_from_context_lengths() -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "max_position_embeddings": 16384,
           "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}}  # fmt: skip
    scaling = ModelConfig.from_dict(cfg).rope_scaling
    assert scaling is not None and scaling["factor"] == 4.0


def test_yarn_without_original_context_is_refused() -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        _inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
