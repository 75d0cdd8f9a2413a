"""Small GGUF files written with gguf.GGUFWriter, for converter tests.

`tiny_model` returns random HF-named float32 weights together with the GGUF file llama.cpp's
convert script would have produced from them (GGUF names, q/k row permutation for llama, merged
expert tensors for qwen3moe), so a test can compare the converter's output with the originals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> character table, written independently of the code under test."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in keep}
    extra = iter(range(256, 512))
    return [chars[b] if b in chars else chr(next(extra)) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIAL_TOKENS + byte_alphabet() + ["Ġt", "he", "Ġthe"]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (HF half-split -> interleaved)."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray | tuple[np.ndarray, GGMLQuantizationType]],
    tokenizer: bool = True,
) -> Path:
    writer = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        _add_value(writer, key, value)
    if tokenizer:
        tokens, types = tiny_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in tensors.items():
        if isinstance(data, tuple):
            writer.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


ARCH_SIZES = {"hidden": 32, "n_head": 4, "n_kv": 2, "head_dim": 8, "ffn": 64, "layers": 2, "experts": 4}


def tiny_model(
    path: Path,
    arch: str,
    seed: int = 0,
    tied: bool = True,
    extra_meta: dict[str, Any] | None = None,
    sizes: dict[str, int] | None = None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Write a 2-layer float32 GGUF of `arch`; return it and the HF-named weights it encodes."""
    rng = np.random.default_rng(seed)
    hidden, n_head, n_kv, head_dim, ffn, layers, experts = {**ARCH_SIZES, **(sizes or {})}.values()
    vocab = len(tiny_vocab()[0])

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": rand(hidden)}
    gg: dict[str, np.ndarray] = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if not tied:
        hf["lm_head.weight"] = gg["output.weight"] = rand(vocab, hidden)
    for layer in range(layers):
        hp, gp = f"model.layers.{layer}.", f"blk.{layer}."
        q, k, v = rand(n_head * head_dim, hidden), rand(n_kv * head_dim, hidden), rand(n_kv * head_dim, hidden)
        hf.update({hp + "self_attn.q_proj.weight": q, hp + "self_attn.k_proj.weight": k, hp + "self_attn.v_proj.weight": v})
        permute = arch == "llama"
        gg[gp + "attn_q.weight"] = llama_cpp_permute(q, n_head) if permute else q
        gg[gp + "attn_k.weight"] = llama_cpp_permute(k, n_kv) if permute else k
        gg[gp + "attn_v.weight"] = v
        pairs = {
            "self_attn.o_proj.weight": ("attn_output.weight", rand(hidden, n_head * head_dim)),
            "input_layernorm.weight": ("attn_norm.weight", rand(hidden)),
            "post_attention_layernorm.weight": ("ffn_norm.weight", rand(hidden)),
        }
        if arch == "qwen2":
            for proj, rows in (("q", n_head), ("k", n_kv), ("v", n_kv)):
                pairs[f"self_attn.{proj}_proj.bias"] = (f"attn_{proj}.bias", rand(rows * head_dim))
        if arch in ("qwen3", "qwen3moe"):
            pairs["self_attn.q_norm.weight"] = ("attn_q_norm.weight", rand(head_dim))
            pairs["self_attn.k_norm.weight"] = ("attn_k_norm.weight", rand(head_dim))
        if arch == "qwen3moe":
            pairs["mlp.gate.weight"] = ("ffn_gate_inp.weight", rand(experts, hidden))
            merged = {"gate": rand(experts, ffn, hidden), "up": rand(experts, ffn, hidden), "down": rand(experts, hidden, ffn)}
            for kind, stacked in merged.items():
                gg[f"{gp}ffn_{kind}_exps.weight"] = stacked
                for expert in range(experts):
                    hf[f"{hp}mlp.experts.{expert}.{kind}_proj.weight"] = stacked[expert]
        else:
            pairs["mlp.gate_proj.weight"] = ("ffn_gate.weight", rand(ffn, hidden))
            pairs["mlp.up_proj.weight"] = ("ffn_up.weight", rand(ffn, hidden))
            pairs["mlp.down_proj.weight"] = ("ffn_down.weight", rand(hidden, ffn))
        for hf_name, (gguf_name, value) in pairs.items():
            hf[hp + hf_name] = value
            gg[gp + gguf_name] = value
    metadata: dict[str, Any] = {
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
    }
    if arch in ("qwen3", "qwen3moe"):  # llama.cpp records head_dim for these (it is not hidden/heads)
        metadata.update({f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim})
    if arch == "qwen3moe":
        metadata.update({f"{arch}.expert_count": experts, f"{arch}.expert_used_count": 2, f"{arch}.expert_feed_forward_length": ffn})
    metadata.update(extra_meta or {})
    return write_gguf(path, arch, metadata, gg), hf
