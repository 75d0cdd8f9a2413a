"""4-bit checkpoints end to end on tiny random models (fp32 activations, CPU): each format's
file, written by tests/w4_builders.py in its published layout, served by the engine with its
linear layers kept packed, gives the same greedy tokens as Hugging Face transformers running the
dequantized weights, and one forward's logits equal within fp32 rounding. Where transformers
loads the quantized file itself (compressed-tensors, symmetric), its greedy output is the
reference too. transformers' GPTQ and AWQ loaders need GPTQModel / AutoAWQ kernels, which are not
installed here; transformers 5.24 with compressed-tensors 0.20.1 cannot load asymmetric
pack-quantized files (it expects the zero points unpacked, [N, G], while the library's compressor
writes them packed, [N/8, G]), so those are checked against compressed-tensors' own decompressor
(tests/unit/test_w4_formats.py). The GPU case runs the Triton dequant-GEMM through the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.layers.w4 import W4LinearFn
from tests.engine_helpers import forward_logits
from tests.tiny_models import hf_greedy, make_tiny_model
from tests.w4_builders import write_dequantized, write_w4_checkpoint

NEW = 32
GROUP = 32  # the tiny models' 64 / 160 inputs; group 128 is covered by the kernel tests
VARIANTS = [  # (arch, format, symmetric, act-order)
    ("llama", "gptq", True, False),
    ("llama", "gptq", False, True),
    ("qwen2", "gptq", True, True),  # q/k/v biases beside the packed weights
    ("llama", "awq", False, False),
    ("llama", "compressed-tensors", True, False),
    ("qwen2", "compressed-tensors", False, False),
]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 40)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for arch in ("llama", "qwen2"):
        out[arch] = tmp_path_factory.mktemp(f"{arch}-float")
        make_tiny_model(arch, out[arch])
    return out


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "-".join(map(str, v)))
def checkpoint(request, sources, tmp_path_factory):
    import transformers as tf

    arch, fmt, sym, desc_act = request.param
    path = tmp_path_factory.mktemp(f"{arch}-{fmt}")
    dequantized = write_w4_checkpoint(sources[arch], path, fmt, GROUP, sym, desc_act, seed=3)
    float_path = tmp_path_factory.mktemp(f"{arch}-{fmt}-dequantized")
    write_dequantized(sources[arch], float_path, dequantized)
    hf = tf.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    return request.param, path, hf


def _packed_layers(llm: LLM) -> int:
    return sum(isinstance(getattr(m, "_linear", None), W4LinearFn) for m in llm.engine.model.modules())


def test_greedy_and_logits_equal_dequantized(checkpoint) -> None:
    (_, fmt, _, _), path, hf = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=4, num_pages=128)
    assert _packed_layers(llm) == 4 * llm.engine.model_config.num_layers  # qkv, o, gate_up, down
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prompts = _prompts()
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW), (fmt, len(prompt))
    ours = forward_logits(llm.engine, [prompts[2]], all_positions=True)[0]
    _assert_no_norm_folding(llm)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompts[2]])).logits[0]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-5, f"{fmt}: max relative logits error {rel:.2e}"


def _assert_no_norm_folding(llm: LLM) -> None:
    """Folding the RMSNorm weights into qkv / gate_up (models/llama.py, the GPU path) needs their
    float weights: the packed layers opt out even where the Triton kernels would allow it."""
    from minisgl.models.llama import DecoderLayer

    layer = llm.engine.model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(layer.self_attn.rotary), "stores_kv", property(lambda self: True))
        patch.setattr(layer.mlp.act, "impl", "triton")
        assert not layer.can_fold_norms()
        if layer.self_attn.qkv_proj.bias is None:  # the same layer with float weights would fold
            patch.setattr(layer.self_attn.qkv_proj, "weight_held_by_fn", False)
            patch.setattr(layer.mlp.gate_up_proj, "weight_held_by_fn", False)
            assert layer.can_fold_norms()


def test_compressed_tensors_greedy_equals_transformers(sources, tmp_path) -> None:
    import transformers as tf

    write_w4_checkpoint(sources["llama"], tmp_path, "compressed-tensors", GROUP, sym=True, seed=4)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", page_size=4, num_pages=128)
    assert _packed_layers(llm) == 8
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for prompt in _prompts():
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, NEW)


def test_partly_quantized_fused_layer_is_refused(sources, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    write_w4_checkpoint(sources["llama"], tmp_path, "gptq", GROUP, sym=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    float_state = load_file(str(sources["llama"] / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del state[f"{name}.{suffix}"]
    state[f"{name}.weight"] = float_state[f"{name}.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="a fused layer's parts must all be quantized"):
        LLM(str(tmp_path), device="cpu", dtype="float32", page_size=4, num_pages=16)


def test_gptq_zero_biases_are_dropped_and_real_ones_refused(sources, tmp_path) -> None:
    """auto-gptq writes an all-zero bias for every quantized layer, with or without one in the
    model: those are dropped; a nonzero bias the model has no place for is an error."""
    from safetensors.torch import load_file, save_file

    write_w4_checkpoint(sources["llama"], tmp_path, "gptq", GROUP, sym=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in state if n.endswith(".qweight")]:
        state[name.replace(".qweight", ".bias")] = torch.zeros(state[name].shape[1], dtype=torch.float16)
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", page_size=4, num_pages=16)
    assert _packed_layers(llm) == 8
    del llm
    state["model.layers.1.mlp.down_proj.bias"][0] = 1.0
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.bias"):
        LLM(str(tmp_path), device="cpu", dtype="float32", page_size=4, num_pages=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_triton_path_equals_dequantized(checkpoint) -> None:
    (_, fmt, _, _), path, hf = checkpoint
    llm = LLM(str(path), device="cuda", dtype="float32", page_size=16, num_pages=64)
    layers = [m._linear for m in llm.engine.model.modules() if isinstance(getattr(m, "_linear", None), W4LinearFn)]
    assert layers and all(fn.impl == "triton" for fn in layers)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prompts = _prompts()
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW), (fmt, len(prompt))
