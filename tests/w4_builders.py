"""Write 4-bit checkpoints for the tests: a round-to-nearest (or GPTQ error-feedback) quantizer and
each format's published packing, written here independently of minisgl's readers.

Layouts (K inputs, N outputs, G groups), as in auto-gptq / GPTQModel, AutoAWQ and
compressed-tensors (whose own `pack_to_int32` packs that format here):
- gptq: qweight int32 [K/8, N] (nibble j of row r = input 8r+j), qzeros int32 [G, N/8] (nibble j of
  column c = output 8c+j) holding zero - 1 (v1), scales fp16 [G, N], g_idx int32 [K].
- awq: qweight int32 [K, N/8], qzeros int32 [G, N/8], nibble i of word c = output 8c + ORDER[i]
  with ORDER = 0 2 4 6 1 3 5 7; scales fp16 [G, N].
- compressed-tensors pack-quantized: weight_packed [N, K/8], weight_scale [N, G], weight_shape,
  weight_zero_point [N/8, G] (asymmetric).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    """One layer, quantized: q [N, K] in 0..15, scales / zeros [N, G], g_idx [K] (group of each input)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        idx = self.g_idx.long()
        return (self.q.float() - self.zeros.float()[:, idx]) * self.scales.float()[:, idx]


def group_index(k: int, group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Each input's group; with an act-order `perm`, groups follow the permuted order (GPTQ)."""
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


def group_params(w: torch.Tensor, g_idx: torch.Tensor, sym: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """min-max scales and zeros per (output, group); scales rounded to the stored dtype."""
    groups = int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale = (2 * cols.abs().amax(dim=1) / 15).clamp_min(1e-8)
            zero = torch.full_like(scale, 8, dtype=torch.int32)
        else:
            lo, hi = cols.amin(dim=1).clamp_max(0), cols.amax(dim=1).clamp_min(0)
            scale = ((hi - lo) / 15).clamp_min(1e-8)
            zero = torch.round(-lo / scale.to(scale_dtype).float()).clamp(1, 15).to(torch.int32)  # >= 1: GPTQ v1 stores zero - 1
        scales[:, g] = scale.to(scale_dtype).float()
        zeros[:, g] = zero
    return scales, zeros


def rtn(w: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None = None,
        scale_dtype: torch.dtype = torch.float16) -> Quantized:  # fmt: skip
    """Round to nearest with min-max group scales."""
    g_idx = group_index(w.shape[1], group_size, perm)
    scales, zeros = group_params(w, g_idx, sym, scale_dtype)
    idx = g_idx.long()
    q = torch.clamp(torch.round(w / scales[:, idx]) + zeros[:, idx], 0, 15).to(torch.int32)
    return Quantized(q, scales, zeros, g_idx)


def gptq(w: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool, damp: float = 0.01,
         scale_dtype: torch.dtype = torch.float16) -> Quantized:  # fmt: skip
    """GPTQ (Frantar et al., 2022): the inputs are quantized in order and each one's rounding
    error is spread over the inputs not yet quantized through the Cholesky factor of the inverse
    Hessian of the layer's inputs (H = X^T X over calibration tokens), one group-sized block at a
    time with the rest updated lazily after each block. A group's scale and zero come from its
    error-updated weights as the group starts. No act-order."""
    w = w.clone().float()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    groups = -(-k // group_size)
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int32)
    q = torch.empty(n, k, dtype=torch.int32)
    for g in range(groups):
        b0, b1 = g * group_size, min((g + 1) * group_size, k)
        block = w[:, b0:b1].clone()
        s, z = group_params(block, torch.zeros(b1 - b0, dtype=torch.int32), sym, scale_dtype)
        scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
        s, z = s[:, 0], z[:, 0].float()
        errors = torch.empty_like(block)
        sub = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            qc = torch.clamp(torch.round(block[:, i] / s) + z, 0, 15)
            q[:, b0 + i] = qc.to(torch.int32)
            err = (block[:, i] - (qc - z) * s) / sub[i, i]
            block[:, i:] -= err[:, None] * sub[i, i:][None, :]
            errors[:, i] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    return Quantized(q, scales, zeros, group_index(k, group_size))


def collect_hessians(model_dir: Path, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """H = X^T X of every decoder linear layer's inputs (by checkpoint weight name) over the
    calibration sequences, from transformers running the float model (fp32, CPU)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hessians: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            def hook(mod, args, key=f"{name}.weight"):  # type: ignore[no-untyped-def]
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                hessians[key] = hessians.get(key, 0) + x.T @ x
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in sequences:
            model(torch.tensor([ids]))
    for handle in hooks:
        handle.remove()
    return hessians


def calibration_sequences(model_dir: Path, count: int = 8, length: int = 160) -> list[list[int]]:
    """Text the fp32 model writes itself: one batch sampled (temperature 1, top-k 50, seeded)
    after a neutral opening."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer("The", return_tensors="pt").input_ids.repeat(count, 1)
    torch.manual_seed(1000)
    with torch.no_grad():
        out = model.generate(ids, do_sample=True, top_k=50, temperature=1.0, max_new_tokens=length - ids.shape[1],
                             min_new_tokens=length - ids.shape[1], pad_token_id=0)  # fmt: skip
    return out.tolist()


def _pack_k(values: torch.Tensor) -> torch.Tensor:
    """[K, N] 0..15 -> int32 [K/8, N], input 8r + j in bits 4j of row r."""
    k, n = values.shape
    assert k % 8 == 0
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= values[j::8].long() << (4 * j)
    return _to_int32(words)


def _pack_n(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, N] 0..15 -> int32 [R, N/8], nibble i of word c = column 8c + order[i]."""
    r, n = values.shape
    assert n % 8 == 0
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for i in range(8):
        words |= values[:, order[i]::8].long() << (4 * i)
    return _to_int32(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(qz: Quantized, v1: bool = True) -> dict[str, torch.Tensor]:
    stored = (qz.zeros - 1) & 0xF if v1 else qz.zeros
    return {"qweight": _pack_k(qz.q.t()), "qzeros": _pack_n(stored.t().contiguous()),
            "scales": qz.scales.t().contiguous().half(), "g_idx": qz.g_idx.clone()}  # fmt: skip


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": _pack_n(qz.q.t().contiguous(), AWQ_PACK_ORDER),
            "qzeros": _pack_n(qz.zeros.t().contiguous(), AWQ_PACK_ORDER),
            "scales": qz.scales.t().contiguous().half()}  # fmt: skip


def ct_tensors(qz: Quantized, sym: bool) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {"weight_packed": pack_to_int32((qz.q - 8).to(torch.int8), 4),
           "weight_scale": qz.scales.clone(), "weight_shape": torch.tensor(list(qz.q.shape))}  # fmt: skip
    if not sym:
        out["weight_zero_point"] = pack_to_int32((qz.zeros - 8).to(torch.int8), 4, packed_dim=0)
    return out


def format_tensors(fmt: str, qz: Quantized, sym: bool) -> dict[str, torch.Tensor]:
    """One layer's tensors in `fmt`'s layout, by suffix."""
    if fmt == "gptq":
        return gptq_tensors(qz)
    if fmt == "awq":
        return awq_tensors(qz)
    assert fmt == "compressed-tensors"
    return ct_tensors(qz, sym)


def quantization_config(fmt: str, group_size: int, sym: bool, desc_act: bool = False) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": sym, "desc_act": desc_act,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False}  # fmt: skip
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}  # fmt: skip
    assert fmt == "compressed-tensors"
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}  # fmt: skip


def _copy_beside_weights(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Copy `src`'s files other than its weights (config, tokenizer) to `dst`; return its state dict."""
    from safetensors.torch import load_file

    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy(item, dst / item.name)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def write_w4_checkpoint(src: Path, dst: Path, fmt: str, group_size: int, sym: bool, desc_act: bool = False,
                        seed: int = 0, quantizer=None) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]  # fmt: skip
    """Copy the float checkpoint in `src` to `dst` with every decoder linear layer quantized in
    `fmt`. `quantizer(name, w) -> Quantized` (default: RTN; act-order with a random permutation
    per layer when `desc_act`). Returns the dequantized weights by layer name (the reference)."""
    from safetensors.torch import save_file

    state = _copy_beside_weights(src, dst)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            out[name] = tensor.contiguous()
            continue
        w = tensor.float()
        if quantizer is not None:
            qz = quantizer(name, w)
        else:
            perm = torch.randperm(w.shape[1], generator=gen) if desc_act else None
            qz = rtn(w, group_size, sym, perm, torch.float32 if fmt == "compressed-tensors" else torch.float16)
        tensors = format_tensors(fmt, qz, sym)
        for suffix, value in tensors.items():
            out[f"{prefix}.{suffix}"] = value
        dequantized[name] = qz.dequantize()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group_size, sym, desc_act)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def write_dequantized(src: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """The float checkpoint with the quantized layers replaced by their dequantized weights."""
    from safetensors.torch import save_file

    state = _copy_beside_weights(src, dst)
    state = {name: dequantized.get(name, tensor).contiguous() for name, tensor in state.items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
