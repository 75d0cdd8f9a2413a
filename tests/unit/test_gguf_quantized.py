"""`--weights gguf`: a GGUF's quantized tensors kept as blocks (models/gguf_weights.py,
layers/quant.py) run like the same file dequantized to float32 (`--weights float32`): same greedy
tokens, logprobs within fp32 rounding. Tiny 2-layer models of every kernel type, mixed types
inside one fused projection, untied heads, biases, an F16 part (that layer stays float), the q/k
row permutation of llama, and each code path of the kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

import tests.gguf_builders as builders
from minisgl import LLM, SamplingParams
from minisgl.models.gguf_table import GGUFTable
from minisgl.models.source import ModelSourceError

# K-quants pack 256 weights a block: every input size a multiple of 256.
SIZES = {"hidden": 256, "n_head": 4, "n_kv": 2, "head_dim": 64, "ffn": 512, "layers": 2}
PROMPTS = [[5, 80, 81, 90, 200, 17], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [100]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)


def _blocks(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with small fp16 scales (gguf cannot quantize K-quants: random bytes are
    as good a test, the reference is the dequantized file)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = {QT.Q4_K: (0, 2), QT.Q6_K: (208,)}[qtype]
    for offset in scales:
        raw[:, offset : offset + 2] = (np.abs(rng.standard_normal(raw.shape[0])) * 2e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def quantized_model(path: Path, arch: str, types: dict[str, QT], tied: bool = True, seed: int = 0) -> Path:
    """tests/gguf_builders.tiny_model with the GGUF tensors named in `types` (by the part of the
    name after `blk.N.`, or the whole name) quantized to that type."""
    rng = np.random.default_rng(seed)
    real_write = builders.write_gguf

    def write(out: Path, arch_: str, metadata: dict[str, Any], tensors: dict[str, Any], tokenizer: bool = True) -> Path:
        converted: dict[str, Any] = {}
        for name, value in tensors.items():
            key = name.split(".", 2)[2] if name.startswith("blk.") else name
            qtype = types.get(key)
            if qtype is None:
                converted[name] = value
            elif qtype in (QT.Q4_K, QT.Q6_K):
                converted[name] = (_blocks(*value.shape, qtype, rng), qtype)
            elif qtype == QT.F16:
                converted[name] = value.astype(np.float16)
            else:
                converted[name] = (quantize(value * 0.05, qtype), qtype)
        return real_write(out, arch_, metadata, converted, tokenizer)

    builders.write_gguf = write  # tiny_model looks the writer up by its module name
    try:
        return builders.tiny_model(path, arch, seed=seed, tied=tied, sizes=SIZES)[0]
    finally:
        builders.write_gguf = real_write


LINEAR = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
          "ffn_up.weight", "ffn_down.weight")  # fmt: skip
SMOLLM_LIKE = {**{name: QT.Q4_1 for name in LINEAR}, "token_embd.weight": QT.Q8_0}
MIXED = {"attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q4_K, "attn_v.weight": QT.Q6_K, "attn_output.weight": QT.Q4_0,
         "ffn_gate.weight": QT.Q8_0, "ffn_up.weight": QT.Q4_0, "ffn_down.weight": QT.Q6_K,
         "token_embd.weight": QT.Q4_0, "output.weight": QT.Q6_K}  # fmt: skip


def _run(path: Path, **kwargs: Any) -> tuple[LLM, list[Any]]:
    # fp32 KV pages on both sides: this compares the weights alone (the GGUF default's fp16 pages
    # are tests/golden/test_kv16.py's and test_embedded_quantized.py's).
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=64, kv_cache_dtype="float32", **kwargs)
    return llm, llm.generate(PROMPTS, GREEDY, use_tqdm=False)


# fp32 rounding of a logprob on these models: each fp32 path lies up to ~1e-4 from the float64
# answer (qwen3/MIXED, 2026-12-02 on Zen 3: the dequantized MKL path 8.6e-5, the quantized
# kernels 3.0e-5), so two fp32 paths may differ by twice that; each against float64 by one.
FP32_LOGPROB = 1e-4


def _assert_same(quant: list[Any], full: list[Any]) -> None:
    for got, want in zip(quant, full):
        ids = got.outputs[0].token_ids
        assert ids == want.outputs[0].token_ids
        for token, a, b in zip(ids, got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert abs(a[token].logprob - b[token].logprob) < 2 * FP32_LOGPROB, (token, a[token], b[token])


def _assert_exact(path: Path, quant: list[Any]) -> None:
    """The quantized run's logprobs within fp32 rounding of the dequantized model in float64
    (transformers on the converted directory, teacher-forced on the quantized run's tokens)."""
    from transformers import AutoModelForCausalLM

    from minisgl.models import source

    hf = AutoModelForCausalLM.from_pretrained(source.resolve_model_dir(str(path)), torch_dtype=torch.float64)
    for prompt, got in zip(PROMPTS, quant):
        ids = got.outputs[0].token_ids
        with torch.no_grad():
            exact = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0], dim=-1)
        for j, token in enumerate(ids):
            want = exact[len(prompt) - 1 + j, token].item()
            assert abs(got.outputs[0].logprobs[j][token].logprob - want) < FP32_LOGPROB, (j, token, want)


def _held(llm: LLM) -> dict[str, list[str]]:
    """{layer: quant types of its matrices} for every layer that holds blocks."""
    from minisgl.layers.quant import QuantEmbedding, QuantLinearFn

    out: dict[str, list[str]] = {}
    for name, module in llm.engine.model.named_modules():
        fn = getattr(module, "_linear", None)
        if isinstance(fn, QuantLinearFn):  # the linear layers and QuantLMHead
            out[name] = [qm.qtype.name for qm in fn.parts]
        if isinstance(module, QuantEmbedding):
            out[name] = [module.qm.qtype.name]
    return out


@pytest.mark.parametrize("arch, types, tied", [("llama", SMOLLM_LIKE, True), ("llama", MIXED, False),
                                               ("qwen2", SMOLLM_LIKE, True), ("qwen3", MIXED, False)])  # fmt: skip
def test_quantized_matches_dequantized(tmp_path: Path, arch: str, types: dict[str, QT], tied: bool) -> None:
    path = quantized_model(tmp_path / "m.gguf", arch, types, tied=tied)
    quant_llm, quant = _run(path)  # a .gguf on CPU: kept quantized by default
    assert quant_llm.engine.config.weights == "gguf" and quant_llm.engine.dtype == torch.float32
    held = _held(quant_llm)
    layer = "model.layers.1."
    if types is MIXED:  # q|k share a type (row-concatenated), v does not: two matrices; gate|up likewise
        assert held[layer + "self_attn.qkv_proj"] == ["Q4_K", "Q6_K"]
        assert held[layer + "mlp.gate_up_proj"] == ["Q8_0", "Q4_0"] and held[layer + "mlp.down_proj"] == ["Q6_K"]
    else:
        assert held[layer + "self_attn.qkv_proj"] == ["Q4_1"] and held[layer + "mlp.gate_up_proj"] == ["Q4_1"]
    assert {"model.embed_tokens", "lm_head"} <= set(held)  # tied or not, both over blocks
    assert all(p.numel() == 0 for n, p in quant_llm.engine.model.named_parameters() if n.endswith("proj.weight"))
    del quant_llm
    _, full = _run(path, weights="float32")
    _assert_same(quant, full)
    _assert_exact(path, quant)


def test_every_isa_gives_the_same_tokens(tmp_path: Path) -> None:
    from minisgl.kernels.cpu_quant import available_isas

    path = quantized_model(tmp_path / "m.gguf", "llama", MIXED, tied=False)
    _, full = _run(path, weights="float32")
    for isa in available_isas():
        llm, quant = _run(path, weights="gguf", cpu_isa=isa)
        assert _held(llm)["model.layers.0.self_attn.o_proj"] == ["Q4_0"]
        _assert_same(quant, full)


def test_a_float_part_keeps_its_layer_float(tmp_path: Path) -> None:
    """attn_v in F16: q|k|v stays a float matmul (dequantized), the other layers hold blocks."""
    path = quantized_model(tmp_path / "m.gguf", "llama", {**SMOLLM_LIKE, "attn_v.weight": QT.F16})
    llm, quant = _run(path)
    held = _held(llm)
    assert "model.layers.0.self_attn.qkv_proj" not in held and held["model.layers.0.self_attn.o_proj"] == ["Q4_1"]
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.weight.shape == (4 * 64 + 2 * 2 * 64, 256)
    del llm
    _, full = _run(path, weights="float32")
    _assert_same(quant, full)


def test_quantized_start_needs_no_float_weights(tmp_path: Path) -> None:
    """The cache directory of a quantized start has config and tokenizer only; a dequantized start
    later adds the float32 weights."""
    from minisgl.models import source

    path = quantized_model(tmp_path / "m.gguf", "llama", SMOLLM_LIKE)
    meta = source.resolve_model_dir(str(path), cache_dir=tmp_path / "cache", float_weights=False)
    assert (meta / "config.json").is_file() and not list(meta.glob("*.safetensors"))
    assert source.resolve_model_dir(str(path), cache_dir=tmp_path / "cache", float_weights=False) == meta
    full = source.resolve_model_dir(str(path), cache_dir=tmp_path / "cache")
    assert full == meta and (full / "model.safetensors").is_file() and (full / "config.json").is_file()


def test_tensor_table_matches_gguf_reader(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = quantized_model(tmp_path / "m.gguf", "qwen2", {**MIXED, "attn_v.weight": QT.F16}, tied=False)
    table, reader = GGUFTable(path), GGUFReader(path)
    assert [t.name for t in table.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(table.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data), ours.name
    assert table.fields["general.architecture"].contents() == "qwen2"
    assert table.fields["qwen2.embedding_length"].contents() == 256


def test_tensor_table_refuses_bad_files(tmp_path: Path) -> None:
    path = quantized_model(tmp_path / "m.gguf", "llama", SMOLLM_LIKE)
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelSourceError, match="past the end"):
        GGUFTable(tmp_path / "short.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ModelSourceError, match="truncated or corrupt"):
        GGUFTable(tmp_path / "head.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ModelSourceError, match="not a GGUF file"):
        GGUFTable(tmp_path / "not.gguf")


def test_prefill_takes_the_gemm_and_decode_the_gemv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of more than GEMV_MAX_ROWS tokens run the tiled GEMM, decode steps the GEMV."""
    from minisgl.kernels import cpu_quant

    path = quantized_model(tmp_path / "m.gguf", "llama", SMOLLM_LIKE)
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=64)
    modes: list[tuple[int, int]] = []
    real = cpu_quant.QuantLib.run

    def spy(self: cpu_quant.QuantLib, x: torch.Tensor, qm: cpu_quant.QuantMatrix, isa_id: int, mode_id: int) -> torch.Tensor:
        modes.append((x.numel() // qm.k, mode_id))
        return real(self, x, qm, isa_id, mode_id)

    monkeypatch.setattr(cpu_quant.QuantLib, "run", spy)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert (len(PROMPTS[1]), 1) in modes and (1, 0) in modes
    assert all(mode == (rows > cpu_quant.GEMV_MAX_ROWS) for rows, mode in modes)


def test_an_isa_the_cpu_lacks_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.kernels import cpu_quant

    path = quantized_model(tmp_path / "m.gguf", "llama", SMOLLM_LIKE)
    monkeypatch.setattr(cpu_quant.load_library(), "supported", ("portable",))  # as on a CPU without AVX2
    with pytest.raises(ModelSourceError, match=r"--cpu-isa: ISA 'avx2' unavailable.*pass --cpu-isa auto"):
        LLM(str(path), device="cpu", page_size=4, num_pages=64, cpu_isa="avx2")
