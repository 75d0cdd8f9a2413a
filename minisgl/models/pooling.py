"""What a checkpoint says about serving it as an embedding model (no torch here).

An embedding checkpoint is recognised by its sentence-transformers files (`modules.json` listing a
`Pooling` module, whose `config.json` names the pooling mode, and maybe a `Normalize` module) or
by a base-model architecture without an LM head (`Qwen3Model`). minisgl pools the final hidden
state of the last token (Qwen3-Embedding and the other decoder embedding models); a checkpoint
asking for another pooling (mean, CLS) is refused rather than served wrongly.

Matryoshka: `dimensions` is honoured where config.json says the model was trained for it
(`is_matryoshka`, or the list `matryoshka_dimensions`, the keys vLLM and sentence-transformers
read); elsewhere only the full size is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from minisgl.models.config import ModelConfig

Task = Literal["generate", "embed"]
TASKS: tuple[str, ...] = ("auto", "generate", "embed")

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding is made from the final hidden states: the last token's, L2-normalized
    when `normalize`. `hidden_size`: the full embedding size. `matryoshka`: whether a smaller
    `dimensions` is allowed (the first values, renormalized); `dimensions`: the sizes it was
    trained for, when the checkpoint lists them (empty: any size up to hidden_size)."""

    hidden_size: int
    normalize: bool = True
    matryoshka: bool = False
    dimensions: tuple[int, ...] = ()

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError (a 400 naming `dimensions`) for a size this model cannot give."""
        if dimensions is None or dimensions == self.hidden_size:
            return
        if not self.matryoshka:
            raise ValueError(f"this model does not support matryoshka representations: 'dimensions' must be "
                             f"{self.hidden_size} (its embedding size) or left out, got {dimensions}")  # fmt: skip
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"'dimensions' must be between 1 and {self.hidden_size} (the model's embedding "
                             f"size), got {dimensions}")  # fmt: skip
        if self.dimensions and dimensions not in self.dimensions:
            sizes = ", ".join(str(d) for d in self.dimensions)
            raise ValueError(f"this model was trained for 'dimensions' of {sizes}; got {dimensions}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling mode, normalize) from the sentence-transformers files, or None without them."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = {str(m.get("type")): str(m.get("path", "")) for m in modules if isinstance(m, dict)}
    if _ST_POOLING not in kinds:
        return None
    pooling = _read_json(model_dir / kinds[_ST_POOLING] / "config.json") or {}
    modes = [key.removeprefix("pooling_mode_") for key, on in pooling.items()
             if key.startswith("pooling_mode_") and on is True]  # fmt: skip
    mode = "+".join(sorted(modes)) or "none"
    return ("last" if mode == "lasttoken" else mode), _ST_NORMALIZE in kinds


def resolve_task(task: str, model_dir: Path, model_config: ModelConfig) -> tuple[Task, PoolerConfig | None]:
    """The task the engine runs (`task`: "auto", "generate" or "embed") and, for embeddings,
    its pooler. "auto" serves embeddings for a checkpoint with sentence-transformers pooling or
    without an LM head. ValueError when the checkpoint cannot run the task asked for."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    st = sentence_transformers_pooling(model_dir)
    if task == "auto":
        task = "embed" if st is not None or not model_config.has_lm_head else "generate"
    if task == "generate":
        if not model_config.has_lm_head:
            raise ValueError(f"the checkpoint in {model_dir} is a base model ({model_config.architecture} without "
                             "its LM head): it serves embeddings (--task embed), not text generation")  # fmt: skip
        return "generate", None
    mode, normalize = st if st is not None else ("last", True)
    if mode != "last":
        raise ValueError(f"the checkpoint in {model_dir} pools embeddings by '{mode}'; minisgl pools the last "
                         "token's hidden state only (decoder embedding models such as Qwen3-Embedding)")  # fmt: skip
    config = _read_json(model_dir / "config.json") or {}
    listed = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    matryoshka = bool(config.get("is_matryoshka")) or bool(listed)
    return "embed", PoolerConfig(model_config.hidden_size, normalize, matryoshka, listed)
