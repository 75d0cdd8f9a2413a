"""GPT-OSS equals Hugging Face transformers on the same random weights (fp32, CPU): greedy tokens
past the 8-token sliding window (prefill chunked over its own cached prefix, then a prefix-cached
continuation) and one forward's logits, through the torch backend and the Triton backend (in the
interpreter); the MXFP4 checkpoint layout (experts as `*_blocks` + `*_scales`) and its
dequantizer; the config's GPT-OSS facts."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kernels.mxfp4 import dequantize_mxfp4
from minisgl.models.config import ModelConfig
from minisgl.models.quant_config import Mxfp4Scheme
from tests.tiny_models import hf_greedy

WINDOW = 8
VOCAB = 256
NEW_TOKENS = 10


def make_tiny_gpt_oss(path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny HF GPT-OSS in fp32, saved to `path`: 3 layers (sliding, full, sliding), 4 q heads on
    2 KV heads, 6 experts top-2, YaRN. A larger init than HF's (sinks and biases included) keeps
    greedy decoding varied and the sinks and biases significant."""
    import transformers as tf

    options: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=WINDOW, max_position_embeddings=512, initializer_range=0.15, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
    )  # fmt: skip
    options.update(overrides)
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**options)).eval()
    # transformers before 5.2x (5.17 on the GPU machine) hard-codes the experts' clamp at 7.0 and
    # alpha at 1.702 instead of reading swiglu_limit / swiglu_alpha: hand the reference this
    # config's values, which minisgl reads from config.json.
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert hasattr(experts, "limit") and hasattr(experts, "alpha"), "transformers renamed GptOssExperts' clamp"
        experts.limit, experts.alpha = float(options["swiglu_limit"]), float(options.get("swiglu_alpha", 1.702))
    with torch.no_grad():  # HF zero-initialises these biases: make them matter
        for name, param in model.named_parameters():
            if name.endswith(("_bias", "sinks", "proj.bias")):
                param.normal_(0.0, 0.5 if name.endswith("sinks") else 0.1)
    model.save_pretrained(path)
    return model


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_tiny_gpt_oss(path)


def _check_greedy_and_cache(llm: LLM, hf_model: torch.nn.Module) -> None:
    prompts = _prompts(1, (5, 30))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 3 for tokens in expected), "degenerate reference output"
    for prompt, exp, got in zip(prompts, expected, _greedy(llm, prompts)):
        assert list(got.outputs[0].token_ids) == exp, f"prompt len {len(prompt)}"
    # Over the 30-token prompt's cached pages (past the window), plus 7 new tokens.
    second = prompts[1] + _prompts(2, (7,))[0]
    (out,) = _greedy(llm, [second])
    assert out.num_cached_tokens >= WINDOW + 4, "the shared prefix was not reused from the cache"
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, second, NEW_TOKENS), "over the cached prefix"


def _check_logits(llm: LLM, hf_model: torch.nn.Module) -> None:
    from tests.engine_helpers import forward_logits

    prompt = _prompts(3, (27,))[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0]
    # All positions in one step, then the last 11 over a cached prefix of 16 (past the window).
    for prefix in (None, [16]):
        ours = forward_logits(llm.engine, [prompt], prefix_lens=prefix, all_positions=True)[0]
        ref = theirs if prefix is None else theirs[16:]
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"max relative logits error {rel:.2e} (prefix {prefix})"


def test_config_reads_gpt_oss(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, _ = tiny
    config = ModelConfig.from_dir(path)
    assert config.architecture == "GptOssForCausalLM" and config.attn_sinks and config.attention_bias
    assert config.num_experts == 6 and config.num_experts_per_tok == 2 and config.moe_intermediate_size == 48
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [config.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_theta == 150000.0 and config.swiglu_limit == 1.5 and config.swiglu_alpha == 1.702


def test_shipped_20b_config() -> None:
    root = Path(__file__).resolve().parents[2]
    config = ModelConfig.from_dir(root / "configs" / "gpt-oss-20b")
    assert config.architecture == "GptOssForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        24, 2880, 64, 8, 64)  # fmt: skip
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert config.sliding_window == 128 and config.layer_types[:2] == ("sliding_attention", "full_attention")
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 32.0 and config.swiglu_limit == 7.0


def test_20b_shapes_on_meta() -> None:
    """The shipped config builds GPT-OSS-20B's 20.9B parameters (on the meta device: no memory)."""
    from minisgl.models.registry import build_model

    root = Path(__file__).resolve().parents[2]
    with torch.device("meta"):
        model = build_model(ModelConfig.from_dir(root / "configs" / "gpt-oss-20b"))
    total = sum(p.numel() for p in model.parameters())
    assert 20.8e9 < total < 21.0e9, total
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (32, 5760, 2880) and experts.down_proj.shape == (32, 2880, 2880)
    assert model.model.layers[0].self_attn.sinks.shape == (64,)


def test_torch_backend_matches_hf(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf_model = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", attn="torch", page_size=4, num_pages=128,
              max_prefill_tokens=16)  # fmt: skip
    _check_greedy_and_cache(llm, hf_model)
    _check_logits(llm, hf_model)


def test_triton_backend_matches_hf(tiny: tuple[Path, torch.nn.Module]) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from minisgl.kernels.attention import is_interpreted

    if not torch.cuda.is_available() and not is_interpreted():
        pytest.skip("triton was imported in compiled mode before the interpreter could be selected")
    path, hf_model = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(str(path), device="cpu", dtype="float32", attn="triton", page_size=4, num_pages=128,
                  max_prefill_tokens=16)  # fmt: skip
        _check_greedy_and_cache(llm, hf_model)
        _check_logits(llm, hf_model)
    finally:
        torch.set_num_threads(threads)


# ---- MXFP4 ----

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp4(code: int) -> float:
    """E2M1 by its bits: sign, two exponent bits, one mantissa bit (bias 1; exponent 0: subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))


def test_e2m1_by_bits() -> None:
    assert [_fp4(c) for c in range(8)] == E2M1 and [_fp4(c + 8) for c in range(8)] == [-v for v in E2M1]


def test_dequantize_mxfp4_matches_hand_built() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 136, (3, 5, 2), dtype=torch.uint8, generator=gen)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 5, 64)
    expected = torch.empty(3, 5, 64)
    for e in range(3):
        for row in range(5):
            for group in range(2):
                scale = 2.0 ** (int(scales[e, row, group]) - 127)
                for byte in range(16):
                    value = int(blocks[e, row, group, byte])
                    expected[e, row, group * 32 + 2 * byte] = _fp4(value & 0x0F) * scale  # low nibble first
                    expected[e, row, group * 32 + 2 * byte + 1] = _fp4(value >> 4) * scale
    assert torch.equal(got, expected)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), expected)  # exact in bf16
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


def _random_mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales for a weight [E, out, in] (in a multiple of 32), values ~0.05-0.4."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(122, 125, (*lead, cols // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


def make_mxfp4_gpt_oss(tmp_path: Path) -> torch.nn.Module:
    """A tiny GPT-OSS checkpoint whose experts are MXFP4 (transformers' layout: blocks
    [E, out, in / 32, 16], scales [E, out, in / 32]; config `quantization_config` mxfp4), and the
    HF model holding the dequantized values as its dense weights."""
    from safetensors.torch import load_file, save_file

    hf_model = make_tiny_gpt_oss(tmp_path, seed=4, intermediate_size=64)
    gen = torch.Generator().manual_seed(1)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in hf_model.model.layers:
        experts = layer.mlp.experts
        prefix = f"model.layers.{layer.self_attn.layer_idx}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # HF: [E, in, out]
            blocks, scales = _random_mxfp4((param.shape[0], param.shape[2], param.shape[1]), gen)
            with torch.no_grad():
                param.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
            del tensors[prefix + proj]
            tensors[prefix + proj + "_blocks"], tensors[prefix + proj + "_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf_model


def test_mxfp4_checkpoint_matches_hf(tmp_path: Path) -> None:
    """The MXFP4 experts, dequantized at load (CPU), decode HF's tokens on the dense values."""
    hf_model = make_mxfp4_gpt_oss(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", page_size=4, num_pages=128)
    assert isinstance(llm.engine.model_config.quantization, Mxfp4Scheme)
    prompts = _prompts(5, (20,))
    expected = hf_greedy(hf_model, prompts[0], NEW_TOKENS)
    assert len(set(expected)) > 3, "degenerate reference output"
    assert list(_greedy(llm, prompts)[0].outputs[0].token_ids) == expected


@pytest.mark.tp
def test_tp2_over_gloo_equals_hf(tmp_path: Path) -> None:
    """Two ranks over gloo, each with half the q/KV heads (and their sinks) and half of every
    expert's intermediate dimension (rank 0 adding the down bias), decode HF's greedy tokens."""
    from tests.golden.test_tp_parity import _prompts as tp_prompts
    from tests.golden.test_tp_parity import _run_tp

    hf_model = make_tiny_gpt_oss(tmp_path, seed=6, vocab_size=512)
    expected = [hf_greedy(hf_model, prompt, 12) for prompt in tp_prompts()]
    for rank, (ids, _params) in sorted(_run_tp(tmp_path, 2).items()):
        assert ids == expected, f"rank {rank} decoded differently from transformers"


def test_mxfp4_resident_engine_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts kept 4-bit, as on CUDA (the fused kernel, here in the interpreter: the layer is
    told the kernel serves), under the checkpoint's own names: the engine still decodes HF's tokens."""
    from minisgl.kernels.attention import is_interpreted

    if not torch.cuda.is_available() and not is_interpreted():
        pytest.skip("triton was imported in compiled mode before the interpreter could be selected")
    import minisgl.layers.moe_swiglu as moe_swiglu

    monkeypatch.setattr(moe_swiglu, "select_moe_impl", lambda impl, device: "triton")
    hf_model = make_mxfp4_gpt_oss(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", page_size=4, num_pages=128)
    experts = [m for m in llm.engine.model.modules() if isinstance(m, moe_swiglu.SwigluExperts)]
    assert experts and all(m.mxfp4 and m.gate_up_proj_blocks.dtype == torch.uint8 for m in experts)
    prompts = _prompts(5, (20,))
    assert list(_greedy(llm, prompts)[0].outputs[0].token_ids) == hf_greedy(hf_model, prompts[0], NEW_TOKENS)
