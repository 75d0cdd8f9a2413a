"""Tiny GGUFs of every supported architecture: our converted directory runs in transformers with
exactly the logits of transformers' own GGUF loader (qkv bias, q/k norms, MoE expert split)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl.models.gguf import convert_gguf
from tests.gguf_builders import tiny_model

# transformers' GGUF config mapping ignores head_dim for qwen3 and the expert width for qwen3moe,
# falling back to the HF defaults (128 and 768), so those tiny models use exactly those sizes.
SIZES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "qwen3moe": {"head_dim": 16, "ffn": 768},
}


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers needs accelerate for GGUF")
@pytest.mark.parametrize("arch", list(SIZES))
def test_tiny_arch_logits_match_hf_gguf_loader(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model(tmp_path / f"{arch}.gguf", arch, tied=arch != "qwen2", sizes=SIZES[arch])
    convert_gguf(path, tmp_path / "out")
    ours, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 70, 100, 200, 3, 261, 2]])
    with torch.no_grad():
        ours_logits, theirs_logits = ours(ids).logits, theirs(ids).logits
    assert ours_logits.abs().max() > 0
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=0)
