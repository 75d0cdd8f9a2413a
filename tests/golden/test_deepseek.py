"""DeepSeek-V2/V3 (multi-head latent attention, group-routed experts) equal Hugging Face
transformers on the same random weights (fp32, CPU): greedy tokens batched and alone, logits of
a whole prompt and of an extend over a cached prefix, a radix-cached continuation, and which
layers are dense."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.models.config import ModelConfig
from tests.deepseek_models import VARIANTS, VOCAB, make_tiny_deepseek
from tests.tiny_models import hf_greedy

NEW_TOKENS = 32


def _prompts(seed: int, lengths: tuple[int, ...] = (1, 9, 23, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    model = make_tiny_deepseek(request.param, path)
    # 16-token prefill chunks: the 70-token prompt extends four times over its own cached prefix.
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=512, max_prefill_tokens=16)
    yield request.param, model, llm
    torch.set_num_threads(threads)


def test_greedy_matches_hf(tiny: Any) -> None:
    variant, hf_model, llm = tiny
    prompts = _prompts(len(variant))
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert len(set(expected[3])) > NEW_TOKENS // 4, f"{variant}: the tiny model collapsed into repeats"
    for prompt, exp, got in zip(prompts, expected, _greedy(llm, prompts, NEW_TOKENS)):
        assert got.outputs[0].token_ids == exp, f"{variant} batched, prompt len {len(prompt)}"
    (alone,) = _greedy(llm, [prompts[2]], NEW_TOKENS)
    assert alone.outputs[0].token_ids == expected[2], f"{variant} alone"


def test_prefix_cached_continuation(tiny: Any) -> None:
    """A second request sharing the first one's 36-token prompt reuses its latent pages from the
    radix cache and extends over them (up-projecting the cached latents); tokens equal HF's."""
    variant, hf_model, llm = tiny
    first, extra = _prompts(100 + len(variant), (36, 21))
    _greedy(llm, [first], 4)
    second = first + extra
    (out,) = _greedy(llm, [second], NEW_TOKENS)
    assert out.num_cached_tokens >= 32, f"{variant}: the shared prefix was not reused from the cache"
    assert out.outputs[0].token_ids == hf_greedy(hf_model, second, NEW_TOKENS), f"{variant}: continuation"


@pytest.mark.parametrize("prefix_len", [0, 45])
def test_logits_match_hf(tiny: Any, prefix_len: int) -> None:
    """One forward's logits (every position), whole or extending a cached 45-token prefix."""
    from tests.engine_helpers import forward_logits

    variant, hf_model, llm = tiny
    prompt = _prompts(7, (70,))[0]
    ours = forward_logits(llm.engine, [prompt], prefix_lens=[prefix_len], all_positions=True)[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0, prefix_len:]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"{variant}: max relative logits error {rel:.2e}"


def test_decode_logits_match_hf(tiny: Any) -> None:
    """Absorbed decode (one token over a cached prefix) against HF's logits at that position."""
    from tests.engine_helpers import forward_logits

    variant, hf_model, llm = tiny
    prompts = _prompts(9, (30, 51))
    ours = forward_logits(llm.engine, prompts, prefix_lens=[len(p) - 1 for p in prompts])
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            theirs = hf_model(torch.tensor([prompt])).logits[0, -1:]
        rel = (got - theirs).abs().max() / theirs.abs().max()
        assert rel < 1e-4, f"{variant}: decode logits error {rel:.2e} at length {len(prompt)}"


def _hf_dict(variant: str, **options: Any) -> tuple[dict[str, Any], list[bool]]:
    import transformers as tf

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2,
                n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=4, n_group=2, topk_group=1, q_lora_rank=None)  # fmt: skip
    config_cls, model_cls = (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM) if variant == "v2" else (
        tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)  # fmt: skip
    config = config_cls(**{**base, **options})
    hf_moe = [type(layer.mlp).__name__.endswith(("Moe", "MoE")) for layer in model_cls(config).model.layers]
    hf = config.to_dict()
    hf["architectures"] = [model_cls.__name__]
    return hf, hf_moe


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("dense", [0, 1, 3])
def test_dense_layers_match_hf(variant: str, dense: int) -> None:
    from minisgl.layers.deepseek_moe import DeepseekMoE
    from minisgl.models.registry import build_model

    hf, hf_moe = _hf_dict(variant, num_hidden_layers=4, first_k_dense_replace=dense)
    ours = build_model(ModelConfig.from_dict(hf))
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in ours.model.layers] == hf_moe


def test_config_reads_the_latent_layout() -> None:
    """The latent cache's per-token width is one "KV head" of kv_lora_rank + rope dim; the
    softmax scale carries yarn's mscale_all_dim correction, squared."""
    hf, _ = _hf_dict("v2", num_hidden_layers=2, rope_scaling={
        "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 0.707,
        "mscale_all_dim": 0.707})  # fmt: skip
    config = ModelConfig.from_dict(hf)
    assert config.deepseek is not None
    assert (config.num_kv_heads, config.head_dim) == (1, 8 + 4)
    mscale = 0.1 * 0.707 * torch.tensor(40.0).log().item() + 1.0
    assert config.softmax_scale == pytest.approx((4 + 4) ** -0.5 * mscale**2)
    assert config.deepseek.topk_method == "greedy" and config.deepseek.scoring_func == "softmax"
    v3, _ = _hf_dict("v3", num_hidden_layers=2)
    v3_config = ModelConfig.from_dict(v3).deepseek
    assert v3_config is not None and v3_config.scoring_func == "sigmoid" and v3_config.rope_interleave


def test_shipped_v2_lite_config_parses() -> None:
    config = ModelConfig.from_dir(Path(__file__).parents[2] / "configs" / "deepseek-v2-lite")
    assert config.architecture == "DeepseekV2ForCausalLM" and config.deepseek is not None
    assert (config.deepseek.kv_lora_rank, config.deepseek.qk_rope_head_dim, config.deepseek.q_lora_rank) == (512, 64, None)
    assert (config.num_experts, config.num_experts_per_tok, config.deepseek.n_shared_experts) == (64, 6, 2)
    assert [config.is_sparse_layer(i) for i in range(3)] == [False, True, True]


def test_triton_engine_matches_hf(tmp_path: Path) -> None:
    """`attn="triton"` on CPU: the MLA layers decode through the Triton kernel (interpreted),
    over the same scheduler, pages and radix cache; greedy tokens still equal HF's."""
    from minisgl.layers.mla import LatentAttention

    hf_model = make_tiny_deepseek("v3", tmp_path)
    prompts = _prompts(5, (3, 21))
    llm = LLM(str(tmp_path), device="cpu", attn="triton", page_size=4, num_pages=128, max_prefill_tokens=16)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, LatentAttention)]
    assert layers and all(layer.decode_impl == "triton" for layer in layers)
    for prompt, got in zip(prompts, _greedy(llm, prompts, 8)):
        assert got.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8), f"prompt len {len(prompt)}"


def test_checkpoint_layers_past_the_model_are_skipped(tmp_path: Path) -> None:
    """A V3 checkpoint's multi-token-prediction layer (`model.layers.<num_hidden_layers>.*`) is not
    loaded (nor an error); the real layers still are."""
    from safetensors.torch import load_file, save_file

    hf_model = make_tiny_deepseek("v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.mlp.gate.weight"] = torch.zeros(8, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path), device="cpu", page_size=4, num_pages=64)
    prompt = _prompts(3, (12,))[0]
    assert _greedy(llm, [prompt], 6)[0].outputs[0].token_ids == hf_greedy(hf_model, prompt, 6)


@pytest.mark.parametrize(
    ("variant", "options"),
    [
        ("v2", {"topk_method": "greedy"}),
        ("v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
        ("v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True}),
        ("v3", {"n_group": 2, "topk_group": 1, "norm_topk_prob": False}),
    ],
)
def test_gate_matches_hf_router(variant: str, options: dict[str, Any]) -> None:
    """Our gate picks HF's experts with HF's weights, token by token (V2 softmax, optionally
    group-limited; V3 sigmoid with its correction bias, groups ranked by their top-2 sum)."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from minisgl.layers.deepseek_moe import GateSpec, GroupLimitedRouter

    common = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    if variant == "v2":
        hf_config = tf.DeepseekV2Config(**common, **options)
        hf_gate: torch.nn.Module = DeepseekV2TopkRouter(hf_config)
    else:
        hf_config = tf.DeepseekV3Config(**common, **options)
        hf_gate = DeepseekV3TopkRouter(hf_config)
        hf_gate.e_score_correction_bias.normal_(0, 0.5)
    torch.nn.init.normal_(hf_gate.weight, std=0.5)
    hf = hf_config.to_dict()
    hf.update(architectures=[f"Deepseek{variant.upper()}ForCausalLM"], num_hidden_layers=1, num_attention_heads=2)
    mla = ModelConfig.from_dict(hf).deepseek
    assert mla is not None
    spec = GateSpec(mla.scoring_func, mla.topk_method, mla.n_group, mla.topk_group, mla.routed_scaling_factor,
                    bool(hf_config.norm_topk_prob))  # fmt: skip
    ours = GroupLimitedRouter(16, 32, 3, spec)
    with torch.no_grad():
        ours.weight.copy_(hf_gate.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf_gate.e_score_correction_bias)
    x = torch.randn(200, 32)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_gate(x)
        routing = ours(x)
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, our_order = routing.ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(routing.weights.gather(1, our_order), hf_weights.gather(1, order))


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.5},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "truncate": False},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "attention_factor": 1.3},
    ],
)  # fmt: skip
def test_yarn_frequencies_match_hf(scaling: dict[str, Any]) -> None:
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl.layers.rotary import _inv_freq

    config = tf.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_scaling=dict(scaling))
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    freq, factor = _inv_freq(64, 10000.0, dict(scaling))
    torch.testing.assert_close(freq, hf_freq, atol=0, rtol=0)
    assert factor == pytest.approx(hf_factor)


def test_yarn_without_its_lengths_is_a_clear_error() -> None:
    from minisgl.layers.rotary import _inv_freq

    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        _inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
