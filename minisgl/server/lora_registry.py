"""The LoRA adapters the API server routes requests to (lora_api.py has the routes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.server.protocol import RequestError


@dataclass
class LoraRegistry:
    """The adapters the API server routes to, by name (path), in load order. `enabled`: the
    engines hold adapter slots (--enable-lora / --lora-modules)."""

    enabled: bool = False
    adapters: dict[str, str] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)  # names with a load or unload under way

    def adapter_for(self, model: str | None, served_model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model). With LoRA on, a name
        that is neither the base model nor a loaded adapter is a 404, as vLLM answers."""
        if model is None or model == "" or model == served_model:
            return None
        if model in self.adapters:
            return model
        if self.enabled:
            raise RequestError(f"The model '{model}' does not exist.", "model", 404)
        return None  # without LoRA any name runs the one model (as before adapters existed)
