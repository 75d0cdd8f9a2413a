"""The fused routing and align kernels (kernels/moe_routing.py) vs their torch references
(kernels/moe_ref.py), and the routers that use them.

Without CUDA the kernels run in Triton's interpreter on small shapes (fp32 and fp16: the
interpreter mis-rounds bf16); the `gpu` tests sweep Qwen3-30B-A3B's and DeepSeek's router shapes
up to a prefill chunk's token count in bf16. Ids must be equal; weights within rounding. The tie
rule: equal logits go to the lower expert id.

What the ids must satisfy, on any device (`_check_ids`): exactly the kernel's rule
(`moe_ref.topk_ids_ref`: the top k logits best first, ties to the lower id); the same scores as
the reference's choice, best first; and the reference's very ids on every row whose scores have no
tie within rounding (`moe_ref.tied_rows_ref`). On tied rows torch.topk orders (or picks) as it
likes, on CPU and CUDA alike: the GPU bench's failed check compared ids on bf16-valued logits.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
# Without CUDA, tests/conftest.py has put triton in interpreter mode before this import.

from minisgl.kernels.moe_ref import (  # noqa: E402
    align_by_expert_ref,
    route_ref,
    route_scores_ref,
    tied_rows_ref,
    topk_ids_ref,
)
from minisgl.kernels.moe_routing import _route_kernel, align_tiles, num_tiles_bound, topk_route  # noqa: E402
from minisgl.layers.moe import TopKRouter  # noqa: E402
from minisgl.layers.moe_swiglu import BiasedTopKRouter  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not CUDA and type(_route_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# Weights: fp32 differs from torch's softmax in exp's and the sum's rounding; 16-bit outputs one step.
TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
MODES = [(True, True), (True, False), (False, False)]  # (softmax_first, renormalize)


def _logits(tokens: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """fp32: Gaussian logits. 16-bit: each row a permutation of distinct values exact in the dtype
    (random 16-bit logits tie often at 128 experts, and ties have their own test)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE)
    perms = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) if tokens else torch.empty(0, experts)
    return ((perms.float() - experts / 2) * (4 / experts)).to(DEVICE, dtype)


def _tied_logits(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Gaussian logits rounded to bf16 (8 significant bits) in fp32: about a third of the rows
    at 128 experts hold two equal logits among their top 9."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=gen) * 2).to(torch.bfloat16).float().to(DEVICE)


def _check_ids(logits: torch.Tensor, ids: torch.Tensor, top_k: int, softmax_first: bool, allow_ties: bool) -> None:
    """The ids' contract (module docstring). Without `allow_ties` the input must have no tie, so
    the ids must equal the reference's on every row."""
    _, ref_ids = route_ref(logits, top_k, softmax_first)  # ids do not depend on renormalising
    assert torch.equal(ids, topk_ids_ref(logits, top_k))
    scores = route_scores_ref(logits, softmax_first).float()
    ref_scores = torch.topk(scores, top_k, dim=-1).values
    torch.testing.assert_close(torch.gather(scores, 1, ids), ref_scores, atol=0, rtol=2.0**-21)
    tied = tied_rows_ref(scores, top_k)
    assert allow_ties or not bool(tied.any())
    assert torch.equal(ids[~tied], ref_ids[~tied])


def _check_route(logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool,
                 allow_ties: bool = False) -> None:  # fmt: skip
    weights, ids = topk_route(logits, top_k, softmax_first, renormalize)
    ref_weights, ref_ids = route_ref(logits, top_k, softmax_first, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    _check_ids(logits, ids, top_k, softmax_first, allow_ties)
    if not allow_ties:
        assert torch.equal(ids, ref_ids)
        atol, rtol = TOLERANCE[logits.dtype]
        torch.testing.assert_close(weights, ref_weights, atol=atol, rtol=rtol)
    else:  # weights in the kernel's order: compare them sorted (tied experts weigh the same)
        atol, rtol = TOLERANCE[logits.dtype]
        torch.testing.assert_close(weights.sort(dim=-1).values, ref_weights.sort(dim=-1).values, atol=atol, rtol=rtol)


def _check_align(ids: torch.Tensor, experts: int, block_m: int) -> None:
    tiles = align_tiles(ids.contiguous(), experts, block_m)
    ref_pairs, ref_experts = align_by_expert_ref(ids, experts, block_m, num_tiles_bound(ids.numel(), experts, block_m))
    assert tiles.block_m == block_m
    assert torch.equal(tiles.sorted_pairs, ref_pairs)
    assert torch.equal(tiles.tile_expert, ref_experts)


# --- routing ---


@pytest.mark.parametrize(("softmax_first", "renormalize"), MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 1), (13, 8, 2), (37, 60, 4), (70, 128, 8)])
def test_route_matches_ref(tokens: int, experts: int, top_k: int, dtype: torch.dtype, softmax_first: bool,
                           renormalize: bool) -> None:  # fmt: skip
    _check_route(_logits(tokens, experts, dtype, seed=tokens), top_k, softmax_first, renormalize)


@pytest.mark.parametrize(("softmax_first", "renormalize"), MODES)
def test_route_ties_go_to_the_lower_id(softmax_first: bool, renormalize: bool) -> None:
    """Rows with exactly equal logits: the chosen ids are the first top_k of a stable descending
    sort, and tied experts get equal weights."""
    logits = torch.tensor(
        [[1.0, 3.0, 3.0, 0.5, 3.0, 2.0], [0.0] * 6, [2.0, 1.0, 2.0, 1.0, 2.0, 1.0], [-1.0, 4.0, -1.0, -1.0, 4.0, 0.0]],
        device=DEVICE,
    )  # fmt: skip
    weights, ids = topk_route(logits, 4, softmax_first, renormalize)
    expected = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(ids, expected)
    chosen = torch.gather(logits, 1, ids)
    same = chosen[:, :, None] == chosen[:, None, :]
    assert torch.equal((weights[:, :, None] == weights[:, None, :]) & same, same)
    ref_weights, _ = route_ref(logits, 4, softmax_first, renormalize)
    # Ties or not, the weights are the chosen logits' weights.
    torch.testing.assert_close(weights.sort(dim=-1).values, ref_weights.sort(dim=-1).values)


@pytest.mark.parametrize(("softmax_first", "renormalize"), MODES)
def test_route_random_ties_follow_the_rule(softmax_first: bool, renormalize: bool) -> None:
    """The GPU bench's failing case in small: random logits with bf16's 8 bits at 128 experts,
    top 8, 40 tokens (three 16-token blocks, the last one part masked). Many rows tie; the ids
    follow the rule on all of them and equal the reference's wherever it has no tie."""
    logits = _tied_logits(40, 128, seed=5)
    assert bool(tied_rows_ref(route_scores_ref(logits, softmax_first), 8).any())  # the case is what it claims
    _check_route(logits, 8, softmax_first, renormalize, allow_ties=True)


def test_check_ids_catches_a_wrong_order() -> None:
    """The contract fails ids that are a valid set in the wrong order, or with a tie broken
    upwards: it is not met by any top-k set."""
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, -1.0]], device=DEVICE)
    ids = topk_route(logits, 3, True, True)[1]
    assert ids.tolist() == [[1, 3, 2]]
    _check_ids(logits, ids, 3, True, allow_ties=True)
    for wrong in ([[3, 1, 2]], [[1, 2, 3]]):
        with pytest.raises(AssertionError):
            _check_ids(logits, torch.tensor(wrong, device=DEVICE), 3, True, allow_ties=True)
    with pytest.raises(AssertionError):  # a tie where none is allowed
        _check_ids(logits, ids, 3, True, allow_ties=False)


def test_route_no_tokens() -> None:
    weights, ids = topk_route(_logits(0, 8, torch.float32), 2, True, True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_routers_use_the_kernel_and_match(impl: str) -> None:
    """The routers with impl='triton' (interpreted here) equal impl='torch' on the same weights."""
    torch.manual_seed(0)
    x = torch.randn(19, 32, device=DEVICE)
    routers = {name: TopKRouter(16, 32, 4, norm_topk_prob=True, impl=name) for name in ("torch", impl)}  # type: ignore[arg-type]
    biased = {name: BiasedTopKRouter(16, 32, 4, impl=name) for name in ("torch", impl)}  # type: ignore[arg-type]
    for group in (routers, biased):
        state = {name: torch.randn_like(p) for name, p in group["torch"].named_parameters()}
        for router in group.values():
            router.to(DEVICE).load_state_dict(state)
        with torch.no_grad():
            ours, ref = group[impl](x), group["torch"](x)
        assert torch.equal(ours.ids, ref.ids)
        torch.testing.assert_close(ours.weights, ref.weights, atol=1e-6, rtol=1e-5)
    assert (routers[impl]._route.__name__ == "topk_route") == (impl == "triton")


# --- align ---


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 1), (13, 8, 2), (64, 8, 2), (40, 6, 3)])
def test_align_matches_ref(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[: tokens // 2, 0] = 1  # one long run
    _check_align(ids.to(DEVICE), experts, block_m)


def test_align_skewed_and_unused_experts() -> None:
    """Every pair on two of 16 experts (the others unused, so many tail tiles), and runs that
    fill their tiles exactly."""
    ids = torch.tensor([[3, 9]] * 32, device=DEVICE)
    _check_align(ids, 16, 16)
    _check_align(ids[:5], 16, 16)


def test_align_qwen3_30b_routing() -> None:
    """128 experts, top 8, ids from the router kernel: several chunks of the pair scan."""
    _, ids = topk_route(_logits(300, 128, torch.float32, seed=3), 8, True, True)
    _check_align(ids, 128, 16)


def test_align_no_pairs() -> None:
    tiles = align_tiles(torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 8, 16)
    assert tiles.sorted_pairs.numel() == 0 and tiles.tile_expert.numel() == 0


# --- GPU sweeps ---


@gpu
@needs_cuda
@pytest.mark.parametrize(("softmax_first", "renormalize"), MODES)
@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (256, 8), (32, 4)])
@pytest.mark.parametrize("tokens", [1, 7, 256, 4097, 8192])
def test_gpu_route_bf16(tokens: int, experts: int, top_k: int, softmax_first: bool, renormalize: bool) -> None:
    # Selection on bf16 logits has many exact ties; the reference's topk over fp32 probabilities
    # breaks them its own way, so compare on fp32 logits for ids and on bf16 for the weights' rounding.
    # (fp32 Gaussian logits at 8192 tokens can still tie within exp's rounding: allowed, by the rule.)
    _check_route(_logits(tokens, experts, torch.float32, seed=tokens), top_k, softmax_first, renormalize,
                 allow_ties=True)  # fmt: skip
    logits = _logits(tokens, experts, torch.bfloat16, seed=tokens)
    weights, ids = topk_route(logits, top_k, softmax_first, renormalize)
    expected = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids, expected)
    ref_weights, _ = route_ref(logits, top_k, softmax_first, renormalize)
    torch.testing.assert_close(weights.sort(dim=-1).values, ref_weights.sort(dim=-1).values, atol=8e-3, rtol=8e-3)


@gpu
@needs_cuda
@pytest.mark.parametrize(("softmax_first", "renormalize"), MODES)
@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (256, 8), (32, 4)])
@pytest.mark.parametrize("tokens", [1, 16, 17, 256, 4097, 8192])
def test_gpu_route_random_ties(tokens: int, experts: int, top_k: int, softmax_first: bool, renormalize: bool) -> None:
    """tools/bench_moe_routing.py's failed check (16 tokens, bf16-valued random logits) as the
    contract states it: the rule on every row, the reference's ids where it has no tie; also in bf16 itself."""
    logits = _tied_logits(tokens, experts, seed=tokens)
    _check_route(logits, top_k, softmax_first, renormalize, allow_ties=True)
    weights, ids = topk_route(logits.to(torch.bfloat16), top_k, softmax_first, renormalize)
    _check_ids(logits, ids, top_k, softmax_first, allow_ties=True)
    ref_weights, _ = route_ref(logits.to(torch.bfloat16), top_k, softmax_first, renormalize)
    torch.testing.assert_close(weights.sort(dim=-1).values, ref_weights.sort(dim=-1).values, atol=8e-3, rtol=8e-3)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("tokens", [1, 64, 1000, 8192])
def test_gpu_align(tokens: int, block_m: int) -> None:
    _, ids = topk_route(_logits(tokens, 128, torch.float32, seed=tokens), 8, True, True)
    _check_align(ids, 128, block_m)
    skewed = torch.randint(0, 4, (tokens, 8), device=DEVICE)
    _check_align(skewed, 128, block_m)
