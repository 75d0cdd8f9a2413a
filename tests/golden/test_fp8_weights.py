"""FP8 weight checkpoints on tiny random models (fp32, CPU), written by the tests in each published
layout (tests/fp8_builders.py):

- compressed-tensors (per tensor, per channel, 32x32 blocks: compressed-tensors wants blocks that
  divide the tiny shapes): greedy tokens equal Hugging Face transformers loading the same
  directory with compressed-tensors, which on CPU emulates W8A8 (float8 weights, dynamic float8
  activations) exactly as the format defines it;
- transformers' own `quant_method: fp8` needs a GPU for W8A8 (on CPU it dequantizes the weights
  and leaves activations float), so the block checkpoint is checked against the same model written
  as compressed-tensors blocks (one quantized model, two layouts: equal tokens), with 128x128
  blocks (partial edge blocks) and 32x32 (several K-groups);
- the Triton kernels (interpreted) equal the torch reference on each format's whole model;
- `--quantization fp8` on the float checkpoint equals llm-compressor's FP8-Dynamic layout of it,
  and `--quantization fp8_block` the 128x128 block checkpoint of it;
- Qwen3-MoE with float8 experts in 128x128 blocks equals the model whose experts hold the
  dequantized weights (the reference computes the experts from dequantized weights).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams
from minisgl.layers.fp8 import Fp8LinearFn, Fp8MoeFn
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from tests.engine_helpers import forward_logits
from tests.fp8_builders import write_fp8_checkpoint
from tests.golden.test_moe_parity import make_tiny_moe
from tests.tiny_models import hf_greedy, make_tiny_model

NEW_TOKENS = 12


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in (5, 17, 30)]


def _greedy(path: Path, prompts: list[list[int]], **kwargs) -> tuple[LLM, list[list[int]]]:  # type: ignore[no-untyped-def]
    llm = LLM(str(path), device="cpu", page_size=16, num_pages=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _fp8_fns(llm: LLM) -> list[Fp8LinearFn]:
    return [m._linear for m in llm.engine.model.modules()  # type: ignore[attr-defined]
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and isinstance(m._linear, Fp8LinearFn)]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_float")
    make_tiny_model("qwen3", path)
    return path


@pytest.mark.parametrize("fmt, block", [("ct-tensor", (128, 128)), ("ct-channel", (128, 128)), ("ct-block", (32, 32))])
def test_compressed_tensors_greedy_equals_transformers(base: Path, tmp_path: Path, fmt: str, block) -> None:  # type: ignore[no-untyped-def]
    import compressed_tensors  # noqa: F401  (transformers' loader for these checkpoints)
    import transformers as tf

    path = write_fp8_checkpoint(base, tmp_path / fmt, fmt, block)  # type: ignore[arg-type]
    hf_model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf_model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn  # W8A8, not dequantized
    prompts = _prompts(1)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    float_model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert expected != [hf_greedy(float_model, p, NEW_TOKENS) for p in prompts]  # the quantization shows
    llm, got = _greedy(path, prompts)
    fns = _fp8_fns(llm)
    assert len(fns) == 2 * 4 and all(fn.qweight.dtype == torch.float8_e4m3fn for fn in fns)  # qkv, o, gate_up, down
    assert got == expected


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_block_checkpoint_equals_the_same_blocks_in_compressed_tensors(base: Path, tmp_path: Path, block) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts(2)
    fp8_llm, fp8 = _greedy(write_fp8_checkpoint(base, tmp_path / "fp8", "fp8-block", block), prompts)
    assert all(fn.group == block[1] for fn in _fp8_fns(fp8_llm))
    _, ct = _greedy(write_fp8_checkpoint(base, tmp_path / "ct", "ct-block", block), prompts)
    assert fp8 == ct


@pytest.mark.parametrize("fmt, block", [("ct-tensor", (128, 128)), ("ct-channel", (128, 128)),
                                        ("fp8-block", (128, 128)), ("fp8-block", (32, 32))])  # fmt: skip
def test_triton_kernels_equal_the_reference_on_the_whole_model(base: Path, tmp_path: Path, fmt: str, block) -> None:  # type: ignore[no-untyped-def]
    """Every layer's `Fp8LinearFn` switched to the (interpreted) Triton kernels: the logits of a
    batch of prompts equal the torch reference's. Each kernel equals the reference up to fp32
    summation order on the same inputs (tests/unit/test_fp8_weights.py); through a whole model
    such a last-bit difference can move one activation across a float8 rounding boundary in a
    later layer, a change of one float8 step in one element, hence 1e-3 rather than 1e-5."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported in compiled mode before the interpreter could be selected")
    llm = LLM(str(write_fp8_checkpoint(base, tmp_path / fmt, fmt, block)), device="cpu", page_size=16, num_pages=64)  # type: ignore[arg-type]
    prompts = _prompts(3)[:2]
    reference = forward_logits(llm.engine, prompts, all_positions=True)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for layer in layers:
        assert isinstance(layer._linear, Fp8LinearFn) and layer._linear.impl == "torch"
        layer.use_weight_fn(layer._linear.with_impl("triton"), sharded=True)
    kernel = forward_logits(llm.engine, prompts, all_positions=True)
    for ref, got in zip(reference, kernel):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_quantization_fp8_at_load_equals_fp8_dynamic_checkpoint(base: Path, tmp_path: Path) -> None:
    """`--quantization fp8` on the float checkpoint quantizes as llm-compressor's FP8-Dynamic does
    (per-channel amax / 448, per-token activations): same float8 bits, same greedy tokens."""
    prompts = _prompts(4)
    at_load, got = _greedy(base, prompts, quantization="fp8")
    shipped, expected = _greedy(write_fp8_checkpoint(base, tmp_path / "ct", "ct-channel"), prompts)
    assert got == expected
    for a, b in zip(_fp8_fns(at_load), _fp8_fns(shipped), strict=True):
        assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
        torch.testing.assert_close(a.scale, b.scale, rtol=0, atol=0)
    _, float_tokens = _greedy(base, prompts)
    assert got != float_tokens  # the model did change


def test_quantization_fp8_block_at_load_equals_the_block_checkpoint(base: Path, tmp_path: Path) -> None:
    """`--quantization fp8_block` on the float checkpoint quantizes as a `quant_method: fp8`
    checkpoint with 128x128 blocks stores it (partial edge blocks on the tiny shapes): same float8
    bits, same row scales and K groups, same greedy tokens."""
    prompts = _prompts(5)
    at_load, got = _greedy(base, prompts, quantization="fp8_block")
    shipped, expected = _greedy(write_fp8_checkpoint(base, tmp_path / "fp8", "fp8-block", (128, 128)), prompts)
    assert got == expected
    for a, b in zip(_fp8_fns(at_load), _fp8_fns(shipped), strict=True):
        assert a.group == b.group == 128
        assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
        torch.testing.assert_close(a.scale, b.scale, rtol=0, atol=0)
    _, float_tokens = _greedy(base, prompts)
    assert got != float_tokens  # the model did change


def test_fp8_block_experts_equal_their_dequantized_weights(tmp_path: Path) -> None:
    """Qwen3-MoE-FP8 layout: the experts' float8 blocks (`weight_scale_inv` per 128x128) load as
    float8 and compute as their dequantized weights do. The second checkpoint is the same file
    with the experts' weights dequantized to fp32 (attention still float8)."""
    make_tiny_moe(tmp_path / "float")
    fp8_dir = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "fp8-block")
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    mixed_dir = tmp_path / "mixed"
    mixed_dir.mkdir()
    for path in fp8_dir.iterdir():
        if path.suffix != ".safetensors":
            (mixed_dir / path.name).write_bytes(path.read_bytes())
    mixed = {}
    for name, tensor in tensors.items():
        if ".experts." in name and name.endswith("weight_scale_inv"):
            continue
        if ".experts." in name and name.endswith(".weight"):
            scale = tensors[name + "_scale_inv"]
            full = scale.repeat_interleave(128, 0)[: tensor.shape[0]].repeat_interleave(128, 1)[:, : tensor.shape[1]]
            tensor = tensor.float() * full
        mixed[name] = tensor
    save_file(mixed, str(mixed_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(5)
    llm, got = _greedy(fp8_dir, prompts)
    experts = [m for m in llm.engine.model.modules() if type(m).__name__ == "FusedExperts"]
    assert len(experts) == 3 and all(isinstance(m.moe_fn, Fp8MoeFn) for m in experts)  # layer 1 is dense
    assert all(m.gate_up_proj.weight.dtype == torch.float8_e4m3fn for m in experts)
    _, expected = _greedy(mixed_dir, prompts)
    assert got == expected
