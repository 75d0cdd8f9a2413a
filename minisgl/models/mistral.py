"""Mistral: the Llama block. Sliding-window attention is not implemented; the engine caps the
context at the window instead (see `ModelConfig.serving_context_len`), so results stay exact."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
