"""Fused Triton MoE vs the torch reference, the expert tiling it runs on, and the layer's choice of
implementation.

Without CUDA the kernels run in Triton's interpreter on small shapes (the unmarked tests, a few
seconds in all; fp32 and fp16: the interpreter mis-rounds bf16). The `gpu` tests sweep token
counts 1..4096 and up to 128 experts at Qwen3-30B-A3B's expert shape in bf16, and replay the
kernel from a CUDA graph; each row of `moe._TILINGS` runs at a token count it is picked for.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
# Without CUDA, tests/conftest.py has put triton in interpreter mode before this import.

from minisgl.kernels.moe import _TILINGS, _gate_up_kernel, _Tiling, align_by_expert, fused_moe  # noqa: E402
from minisgl.kernels.moe_ref import moe_ref  # noqa: E402
from minisgl.layers.moe import SparseMoeBlock, TopKRouter, select_moe_impl  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not CUDA and type(_gate_up_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# (atol, rtol) at outputs of magnitude ~1: fp32 differs only in GEMM summation order; 16-bit
# outputs may sit one rounding step apart where an intermediate landed on a rounding boundary.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def _case(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0,
    skew: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Inputs scaled so every intermediate is O(1); routing from a real top-k softmax router.
    `skew` routes most tokens to the first experts (unused experts, long runs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    router = TopKRouter(experts, hidden, top_k, norm_topk_prob=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen))
        if skew:
            router.weight[: max(1, experts // 4)] += 3.0 * x.mean(0) / x.mean(0).norm()
        weights, ids = router(x)
    return x.to(DEVICE, dtype), w13.to(DEVICE, dtype), w2.to(DEVICE, dtype), weights.to(DEVICE, dtype), ids.to(DEVICE)


def _check(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, **kw: bool) -> None:
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, **kw)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


# --- the expert tiling ---


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(1, 4, 1, 16), (13, 8, 2, 16), (64, 8, 2, 32)])
def test_align_by_expert_tiles(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    ids[:, 0] = 0  # one long run
    tiles = align_by_expert(ids.to(DEVICE), experts, block_m)  # compiled Triton reads device memory only
    num_pairs = tokens * top_k
    pairs = tiles.sorted_pairs.view(-1, block_m).long().cpu()
    real = pairs < num_pairs
    # Every (token, k) pair exactly once, in order within its expert.
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tiles.tile_expert.tolist()):
        if expert == experts:  # past the used tiles: only padding
            assert not real[tile].any()
            continue
        members = pairs[tile][real[tile]]
        assert members.numel() > 0 and (flat[members] == expert).all()
        assert members.tolist() == sorted(members.tolist())
    # Tiles are grouped by expert in increasing order and unused tiles come last.
    tile_experts = tiles.tile_expert.tolist()
    used = [e for e in tile_experts if e < experts]
    assert used == sorted(used) and tile_experts[len(used):] == [experts] * (len(tile_experts) - len(used))


# --- kernel vs reference (interpreter on CPU, compiled on CUDA) ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("tokens", [1, 5, 33, 64])
def test_fused_moe_matches_ref(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    _check(tokens, experts, top_k, 64, 32, dtype)


@pytest.mark.parametrize(("hidden", "inter"), [(80, 40), (48, 96)])
def test_fused_moe_ragged_dims_and_skewed_routing(hidden: int, inter: int) -> None:
    """Hidden and intermediate sizes that are not multiples of the tiles; most tokens on a few
    experts, some experts unused."""
    _check(37, 8, 2, hidden, inter, torch.float32, skew=True)
    _check(37, 8, 3, hidden, inter, torch.float16, skew=True)


def test_fused_moe_no_tokens() -> None:
    x, w13, w2, weights, ids = _case(0, 4, 2, 64, 32, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 64)


def test_layer_triton_matches_torch() -> None:
    """The block with impl='triton' (interpreted here) equals impl='torch' on the same weights."""
    torch.manual_seed(0)
    blocks = {impl: SparseMoeBlock(8, 2, 64, 32, norm_topk_prob=True, impl=impl) for impl in ("torch", "triton")}
    state = {name: torch.randn_like(p) * 0.2 for name, p in blocks["torch"].named_parameters()}
    for block in blocks.values():
        block.load_state_dict(state)
    assert blocks["triton"].experts.impl == "triton" and blocks["torch"].experts.impl == "torch"
    x = torch.randn(19, 64)
    torch.testing.assert_close(blocks["triton"](x), blocks["torch"](x), atol=1e-5, rtol=1e-5)


def test_select_moe_impl() -> None:
    assert select_moe_impl("auto", torch.device("cpu")) == "torch"
    assert select_moe_impl("torch", torch.device("cuda")) == "torch"
    assert select_moe_impl("triton", torch.device("cpu")) == "triton"
    assert select_moe_impl("auto", torch.device("cuda")) == "triton"


# --- GPU sweeps ---

QWEN3_30B = (2048, 768)  # hidden, moe_intermediate per expert (TP 1)


@gpu
@needs_cuda
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (64, 8), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 257, 1024, 4096])
def test_gpu_sweep_bf16(tokens: int, experts: int, top_k: int) -> None:
    _check(tokens, experts, top_k, *QWEN3_30B, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 300, 2048])
def test_gpu_sweep_other_dtypes(tokens: int, dtype: torch.dtype) -> None:
    _check(tokens, 128, 8, *QWEN3_30B, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gpu_tp_shard_shapes(tp: int) -> None:
    """Intermediate slices of TP ranks (768 / tp: 384, 192, 96 - not a multiple of the tile)."""
    _check(200, 128, 8, QWEN3_30B[0], QWEN3_30B[1] // tp, torch.bfloat16, skew=True)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay() -> None:
    """Captured once, replayed with new inputs and routing: equals eager (no host reads inside)."""
    x, w13, w2, weights, ids = _case(48, 128, 8, *QWEN3_30B, torch.bfloat16, seed=1)
    static = [x.clone(), weights.clone(), ids.clone()]
    fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    x2, _, _, weights2, ids2 = _case(48, 128, 8, *QWEN3_30B, torch.bfloat16, seed=2)
    for tensor, new in zip(static, (x2, weights2, ids2)):
        tensor.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x2, w13, w2, weights2, ids2), atol=0, rtol=0)


def test_explicit_tiling_matches_default() -> None:
    """`run_experts(tiling=...)` (the tiles sweep's hook): another tile than `_tiling`'s pick, still equal to the reference."""
    from minisgl.kernels.moe import _Tiling, _tiling, dense_weights, run_experts

    x, w13, w2, weights, ids = _case(21, 8, 2, 64, 32, torch.float32)
    assert _tiling(42, 8, torch.float32).block_m == 16
    out = run_experts(x, dense_weights(w13), dense_weights(w2), weights, ids, tiling=_Tiling(32, 32, 32, 4, 2))
    torch.testing.assert_close(out, moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_tiling_table() -> None:
    """`_tiling` reads its table by rows per expert (bounds rising, the last unbounded): `_TILINGS`
    for dense 16-bit weights, `_NARROW` for MXFP4, and `_NARROW` at BLOCK_K 32 for fp32."""
    from minisgl.kernels.moe import _NARROW, _tiling

    for table in (_TILINGS, _NARROW):
        bounds = [most for most, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] == float("inf")
    for table, dtype, mxfp4, block_k in ((_TILINGS, torch.bfloat16, False, None), (_TILINGS, torch.float16, False, None),
                                         (_NARROW, torch.bfloat16, True, None), (_NARROW, torch.float32, False, 32)):  # fmt: skip
        previous = 0.0
        for most, tiling in table:
            for rows in {previous + 1, min(most, 4 * previous + 64)}:
                expected = tiling._replace(block_k=block_k) if block_k else tiling
                assert _tiling(int(rows * 128), 128, dtype, mxfp4) == expected
            previous = most


@pytest.mark.parametrize("tiling", [tiling for _, tiling in _TILINGS], ids=str)
def test_every_table_tiling_matches_ref(tiling: _Tiling) -> None:
    """Each 16-bit tiling of `_TILINGS` (fp16 here; the interpreter mis-rounds bf16), on ragged
    dims and skewed routing, equals the reference."""
    from minisgl.kernels.moe import dense_weights, run_experts

    x, w13, w2, weights, ids = _case(37, 8, 2, 96, 48, torch.float16, skew=True)
    out = run_experts(x, dense_weights(w13), dense_weights(w2), weights, ids, tiling=tiling)
    atol, rtol = TOLERANCE[torch.float16]
    torch.testing.assert_close(out, moe_ref(x, w13, w2, weights, ids), atol=atol, rtol=rtol)


@gpu
@needs_cuda
@pytest.mark.parametrize("row", range(len(_TILINGS)))
def test_gpu_table_tilings_at_their_sizes(row: int) -> None:
    """Each row of `_TILINGS` at Qwen3-30B-A3B's shape in bf16, at a token count it is picked for
    (up to 8192 tokens: 512 rows per expert), through the default path and equal to the reference."""
    from minisgl.kernels.moe import _tiling

    most, tiling = _TILINGS[row]
    tokens = int(min(most, 512) * 128 / 8)
    assert _tiling(tokens * 8, 128, torch.bfloat16) == tiling
    _check(tokens, 128, 8, *QWEN3_30B, torch.bfloat16)
