"""Qwen2 / Qwen2.5: the Llama block with a bias on the q/k/v projections (set from the config)."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
