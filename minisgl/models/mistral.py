"""Mistral: the Llama block with sliding-window attention on every layer where the config sets
`sliding_window` (v0.1's 4096; later versions have none). The attention backend masks by the
window, so the full `max_position_embeddings` context is served."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
