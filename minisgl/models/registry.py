from __future__ import annotations

from torch import nn

from minisgl.models.config import ModelConfig


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate the architecture named by the config (imports only the family needed)."""
    arch = config.architecture
    if arch == "LlamaForCausalLM":
        from minisgl.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config)
    if arch == "MistralForCausalLM":
        from minisgl.models.mistral import MistralForCausalLM

        return MistralForCausalLM(config)
    if arch == "Qwen2ForCausalLM":
        from minisgl.models.qwen2 import Qwen2ForCausalLM

        return Qwen2ForCausalLM(config)
    if arch == "Qwen3ForCausalLM":
        from minisgl.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM(config)
    if arch == "Qwen3MoeForCausalLM":
        from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(config)
    raise ValueError(f"unsupported architecture {arch!r}")
