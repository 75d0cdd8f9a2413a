"""Gemma 3 text: the Gemma 2 block (models/gemma2.py) with per-head q/k norms (Gemma's RMSNorm)
and no soft-capping; 5 sliding-window layers to 1 global (`layer_types`, else
`sliding_window_pattern`), the sliding layers on their own rope base (`rope_local_base_freq`,
10k, unscaled), the global ones on `rope_theta` (1M) with the config's rope scaling.

`Gemma3ForConditionalGeneration` checkpoints (4B and up) are served text-only: the language
model's weights are renamed onto this model and the vision tower and projector are skipped.
"""

from __future__ import annotations

from minisgl.models.gemma2 import Gemma2ForCausalLM

# Where the multimodal checkpoints keep the language model (transformers 4 and 5 layouts).
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))  # fmt: skip
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    pass


class Gemma3ForConditionalGeneration(Gemma2ForCausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        """The text model's parameter name for a checkpoint tensor, or None to skip it."""
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, target in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return target + name[len(prefix) :]
        return name
