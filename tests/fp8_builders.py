"""FP8 checkpoints for the tests, written from a float one in each published layout (independent of
minisgl's own quantizer, kernels/fp8_ref.py):

- compressed-tensors `float-quantized` as llm-compressor saves FP8-Dynamic (`FP8_DYNAMIC`: weights
  per channel, `weight_scale` [N, 1]; per tensor: [1]) and FP8-Block (`FP8_BLOCK`: 128x128
  blocks, `weight_scale` [ceil(N / 128), ceil(K / 128)], inputs per 128-group); `ignore: [lm_head]`;
- transformers' fine-grained FP8 (`quant_method: fp8`, Qwen3-*-FP8 / DeepSeek-V3):
  `weight_scale_inv` [ceil(N / b0), ceil(K / b1)] per `weight_block_size` block.

Every projection inside the decoder layers (attention, MLP, MoE experts) is quantized; the
embedding, norms, MoE routers and the LM head stay float.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

Fp8Format = Literal["ct-tensor", "ct-channel", "ct-block", "fp8-block"]
FORMATS: tuple[Fp8Format, ...] = ("ct-tensor", "ct-channel", "ct-block", "fp8-block")
_QUANTIZED = re.compile(r"\.layers\.\d+\..*_proj\.weight$")
E4M3_MAX = 448.0


def _to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [N, K], scales [ceil(N / b0), ceil(K / b1)]): each block's amax / 448."""
    n, k = w.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = tile.abs().max() / E4M3_MAX
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return _to_fp8(w, full), scale


def _quantize(w: torch.Tensor, fmt: Fp8Format, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    w = w.float()
    if fmt == "ct-tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(1)
        return {"weight": _to_fp8(w, scale), "weight_scale": scale}
    if fmt == "ct-channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        return {"weight": _to_fp8(w, scale), "weight_scale": scale}
    q, scale = quantize_blocks(w, block)
    return {"weight": q, "weight_scale" if fmt == "ct-block" else "weight_scale_inv": scale}


def quantization_config(fmt: Fp8Format, block: tuple[int, int] = (128, 128)) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    strategy = fmt.removeprefix("ct-")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": list(block) if strategy == "block" else None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
              "strategy": "group" if strategy == "block" else "token",
              "group_size": block[1] if strategy == "block" else None, "block_structure": None,
              "actorder": None, "observer": None, "observer_kwargs": {}}  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None, "format": "float-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
    }  # fmt: skip


def write_fp8_checkpoint(src: Path, dst: Path, fmt: Fp8Format, block: tuple[int, int] = (128, 128)) -> Path:
    """`src` (a float HF directory, one safetensors file) as an FP8 checkpoint in `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _QUANTIZED.search(name) and tensor.dim() == 2:
            stem = name.removesuffix("weight")
            out.update({stem + key: value.contiguous() for key, value in _quantize(tensor, fmt, block).items()})
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, block)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
