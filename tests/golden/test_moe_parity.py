"""Qwen3-MoE equals Hugging Face transformers on the same random weights (fp32, CPU): greedy tokens
batched and alone, logits, which layers are sparse, and tensor-parallel expert slices."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.distributed import TPInfo, get_tp_info, set_tp_info
from minisgl.models.config import ModelConfig
from tests.tiny_models import hf_greedy

NEW_TOKENS = 48
VOCAB = 512


def make_tiny_moe(path: Path, seed: int = 0, vocab_size: int = VOCAB, **overrides: Any) -> torch.nn.Module:
    """Build, save and return a tiny HF Qwen3-MoE in fp32: 4 layers (layer 1 dense), 8 experts,
    top-2, GQA. A larger init than HF's keeps greedy decoding from collapsing to one token."""
    import transformers as tf

    options: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    options.update(overrides)
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**options)).eval()
    model.save_pretrained(path)
    return model


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 23, 70)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, make_tiny_moe(path)


def test_greedy_matches_hf(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf_model = tiny
    prompts = _prompts(11)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 3 for tokens in expected), "degenerate reference output"
    llm = LLM(str(path), device="cpu", page_size=16, num_pages=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, exp, got in zip(prompts, expected, batched):
        assert got.outputs[0].token_ids == exp, f"batched, prompt len {len(prompt)}"
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == expected[1]


@pytest.mark.parametrize(
    "variant",
    [
        {},
        # Unnormalised top-3 weights, every other layer sparse (1 and 3).
        {"norm_topk_prob": False, "num_experts_per_tok": 3, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ],
    ids=["default", "top3-unnormalised-step2"],
)
def test_logits_match_hf(tmp_path: Path, variant: dict[str, Any]) -> None:
    from tests.engine_helpers import forward_logits

    hf_model = make_tiny_moe(tmp_path, seed=3, **variant)
    prompt = _prompts(7)[2]
    llm = LLM(str(tmp_path), device="cpu", page_size=4, num_pages=64)
    ours = forward_logits(llm.engine, [prompt], all_positions=True)[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"max relative logits error {rel:.2e}"


@pytest.mark.parametrize(("step", "mlp_only"), [(1, []), (1, [0, 2]), (2, []), (3, [2])])
def test_sparse_layers_match_hf(step: int, mlp_only: list[int]) -> None:
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from minisgl.layers.moe import SparseMoeBlock
    from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM

    hf_config = tf.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        decoder_sparse_step=step, mlp_only_layers=mlp_only,
    )  # fmt: skip
    hf_layers = tf.Qwen3MoeForCausalLM(hf_config).model.layers
    hf_sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf_layers]
    hf_dict = hf_config.to_dict()
    hf_dict["architectures"] = ["Qwen3MoeForCausalLM"]
    ours = Qwen3MoeForCausalLM(ModelConfig.from_dict(hf_dict))
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == hf_sparse


@pytest.fixture
def restore_tp() -> Any:
    saved = get_tp_info()
    yield
    set_tp_info(saved)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_expert_slices_sum_to_full(restore_tp: None, tp_size: int) -> None:
    """Each rank loads only its intermediate slice of every expert; the ranks' partial outputs
    (what the all-reduce sums) add up to the unsharded output."""
    from minisgl.layers.moe import FusedExperts, TopKRouter

    torch.manual_seed(0)
    num_experts, hidden, inter = 8, 64, 32
    ckpt = {
        (expert, proj): torch.randn(*((hidden, inter) if proj == "down" else (inter, hidden))) * 0.2
        for expert in range(num_experts) for proj in ("gate", "up", "down")
    }  # fmt: skip

    def build(rank: int, size: int) -> FusedExperts:
        set_tp_info(TPInfo(rank, size))
        experts = FusedExperts(num_experts, hidden, inter, impl="torch")
        for (expert, proj), tensor in ckpt.items():
            param = experts.down_proj.weight if proj == "down" else experts.gate_up_proj.weight
            param.weight_loader(param, tensor, f"{expert}:{proj}")  # type: ignore[attr-defined]
        return experts

    x = torch.randn(10, hidden)
    router = TopKRouter(num_experts, hidden, 2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight, std=0.5)
    routing = router(x)
    full = build(0, 1)
    assert full.down_proj.weight.shape == (num_experts, hidden, inter)
    expected = full(x, routing)
    partials = []
    for rank in range(tp_size):
        shard = build(rank, tp_size)
        assert shard.gate_up_proj.weight.shape == (num_experts, 2 * inter // tp_size, hidden)
        # The forward without its all-reduce: the kernel on this rank's weights.
        partials.append(shard._fn(x, shard.gate_up_proj.weight, shard.down_proj.weight, *routing))
    torch.testing.assert_close(torch.stack(partials).sum(0), expected, atol=1e-5, rtol=1e-5)


def test_num_local_experts_and_sparse_fields_read() -> None:
    """transformers 5 writes `num_local_experts`; the original Qwen3-MoE configs `num_experts`."""
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "moe_intermediate_size": 4, "num_experts_per_tok": 2}  # fmt: skip
    for key in ("num_experts", "num_local_experts"):
        config = ModelConfig.from_dict({**base, key: 6, "mlp_only_layers": [3], "decoder_sparse_step": 1})
        assert config.num_experts == 6 and config.mlp_only_layers == (3,)
        assert [config.is_sparse_layer(i) for i in range(4)] == [True, True, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph_bs", [16, 0])
def test_gpu_fp32_fused_kernel_equals_hf(tiny: tuple[Path, torch.nn.Module], graph_bs: int) -> None:
    """On CUDA the layer runs the fused Triton MoE (fp32 GEMMs without TF32), with and without
    CUDA graphs: greedy output still equals HF's on CPU."""
    path, hf_model = tiny
    prompts = _prompts(11)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(path), device="cuda", dtype="float32", page_size=16, num_pages=256, cuda_graph_max_bs=graph_bs)
    experts = [m for m in llm.engine.model.modules() if type(m).__name__ == "FusedExperts"]
    assert experts and all(m.impl == "triton" for m in experts)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for got, exp in zip(llm.generate(prompts, params, use_tqdm=False), expected):
        assert got.outputs[0].token_ids == exp
