"""Qwen3 dense: the Llama block with per-head RMSNorm on q and k before rotary (`qk_norm`)."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
