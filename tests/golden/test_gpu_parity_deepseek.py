"""GPU correctness of DeepSeek-V2/V3 (tests/deepseek_models.py): the MLA layers decode through the
Triton kernel (captured in CUDA graphs) and extend through the up-projection path. fp32 greedy
equals Hugging Face; bf16 up to the first divergence, where both tokens sit in the other side's
top-5. Prompts reach 130 tokens and decode 48 more, with 64-token prefill chunks over the cached
prefix. A last test runs DeepSeek-V2-Lite's real shapes (the shipped config, 2 of its layers,
dummy weights) through captured decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from tests.deepseek_models import VARIANTS, VOCAB, make_tiny_deepseek
from tests.engine_helpers import check_top5_at_divergence
from tests.golden.gpu_parity import (
    NEW,
    bf16_on_gpu,
    check_greedy_equals_hf,
    fp32_graph_llm,
    greedy_ids,
    parity_llm,
    parity_prompts,
    tiny_models,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

tiny = tiny_models(VARIANTS, make_tiny_deepseek)


def _prompts() -> list[list[int]]:
    return parity_prompts(26, VOCAB)


@pytest.mark.parametrize("graph_bs", [16, 0])
def test_fp32_triton_equals_hf(tiny, graph_bs):
    from minisgl.layers.mla import LatentAttention

    variant, path, hf = tiny
    llm = fp32_graph_llm(path, graph_bs)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, LatentAttention)]
    assert layers and all(layer.decode_impl == "triton" for layer in layers)
    check_greedy_equals_hf(llm, hf, _prompts(), f"{variant} (graphs up to {graph_bs})")


def test_bf16_top5_at_divergence(tiny):
    variant, path, hf = tiny
    llm = parity_llm(path, "bfloat16")
    check_top5_at_divergence(llm, bf16_on_gpu(hf), _prompts(), NEW, variant, near_tie=routing_near_tie)


# Router score gap under which bf16 rounding may pick the other expert (group): sigmoid scores
# near 0.5 move by ~1e-2 when the hidden row moves by bf16's 2^-8.
ROUTER_TIE = 0.02


def _router_margin(router: torch.nn.Module, hidden: torch.Tensor) -> float:
    """The smallest gap, in `router`'s fp32 scores of one hidden row [1, H], between what it picks
    and what it leaves: the last chosen group and the next, the k-th allowed expert and the next."""
    cfg = router.cfg
    logits = torch.nn.functional.linear(hidden.float(), router.weight.float())[0]
    if cfg.scoring_func == "softmax":
        scores = logits.softmax(-1)
        group_best = scores.view(cfg.n_group, -1).amax(-1)
        grouped = cfg.topk_method == "group_limited_greedy"
    else:
        scores = logits.sigmoid() + router.e_score_correction_bias.float()
        group_best = scores.view(cfg.n_group, -1).topk(2, dim=-1)[0].sum(-1)
        grouped = True
    gaps = []
    if grouped and cfg.topk_group < cfg.n_group:
        ranked = group_best.sort(descending=True).values
        gaps.append((ranked[cfg.topk_group - 1] - ranked[cfg.topk_group]).item())
        scores = scores.view(cfg.n_group, -1)[group_best.topk(cfg.topk_group).indices].flatten()
    ranked = scores.sort(descending=True).values
    gaps.append((ranked[router.top_k - 1] - ranked[router.top_k]).item())
    return min(gaps)


def routing_near_tie(llm: LLM, context: list[int], theirs: int) -> str | None:
    """A bf16 divergence outside the top-5 is accepted as a checked routing near-tie only when our
    one forward of `context` (transformers' path: the up-projected extend) picks transformers'
    token, and our decode step of its last token (the absorbed path, other rounding) routes that
    token to other experts at a layer whose router separates them by under ROUTER_TIE (one flipped
    expert of a tiny random MoE moves the logits by far more than the top-5)."""
    from minisgl.layers.deepseek_moe import GroupLimitedRouter
    from tests.engine_helpers import forward_logits

    seen: list[tuple[list[int], float]] = []

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
        seen.append((sorted(out.ids[-1].tolist()), _router_margin(module, args[0][-1:])))  # type: ignore[attr-defined]

    hooks = [m.register_forward_hook(hook) for m in llm.engine.model.modules() if isinstance(m, GroupLimitedRouter)]
    try:
        extend = forward_logits(llm.engine, [context], first_page=200)[0][0]
        extend_routes = list(seen)
        seen.clear()
        forward_logits(llm.engine, [context], prefix_lens=[len(context) - 1], first_page=100)
        decode_routes = seen[-len(extend_routes) :]
    finally:
        for handle in hooks:
            handle.remove()
    if int(extend.argmax()) != theirs:
        return f"our one forward picks {int(extend.argmax())}, not transformers' {theirs}"
    flips = [(e, d) for e, d in zip(extend_routes, decode_routes) if e[0] != d[0]]
    if not any(e[1] < ROUTER_TIE for e, _ in flips):
        return f"no routing near-tie: extend vs decode routes {extend_routes} / {decode_routes}"
    return None


def test_v2_lite_shapes_decode_in_graphs(tmp_path: Path) -> None:
    """kv_lora_rank 512, rope 64, 16 heads, 64 experts: captured decode (the Triton MLA kernel)
    gives the same greedy tokens as eager decode on dummy weights, and finite logits."""
    config = json.loads((Path(__file__).parents[2] / "configs" / "deepseek-v2-lite" / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 100_000) for _ in range(n)] for n in (5, 300, 1000)]
    results = []
    for graph_bs in (8, 0):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", dummy_weights=True, page_size=16,
                  num_pages=512, cuda_graph_max_bs=graph_bs)  # fmt: skip
        results.append(greedy_ids(llm, prompts, 16))
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]
