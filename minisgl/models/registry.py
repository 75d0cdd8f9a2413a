from __future__ import annotations

import importlib

from torch import nn

from minisgl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

# architecture -> the module under minisgl.models that defines it (imported only when used)
_MODULES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "GptOssForCausalLM": "gpt_oss",
}
assert set(_MODULES) == set(SUPPORTED_ARCHITECTURES), "every supported architecture needs its module"


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate the architecture named by the config (imports only the family needed)."""
    arch = config.architecture
    module = _MODULES.get(arch)
    if module is None:
        raise ValueError(f"unsupported architecture {arch!r}; minisgl supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    cls = getattr(importlib.import_module(f"minisgl.models.{module}"), arch)
    return cls(config)
