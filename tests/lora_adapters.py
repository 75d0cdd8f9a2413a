"""Random PEFT LoRA adapters for a tiny base (tests/tiny_models.py), saved with PEFT's own
`save_pretrained`: what the LoRA parity and serving tests load."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: torch.nn.Module, path: Path, rank: int, alpha: float, targets: list[str], seed: int,
                 use_rslora: bool = False) -> None:  # fmt: skip
    """A LoRA adapter with random A and B (PEFT starts B at zero, which would change nothing),
    large enough to move greedy tokens; `base` is left as it was."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False)  # fmt: skip
    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.25)
    model.save_pretrained(str(path))


def peft_model(base: torch.nn.Module, path: Path) -> torch.nn.Module:
    """The base with the adapter at `path` applied by PEFT (a copy; `base` stays as it was)."""
    import copy

    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
