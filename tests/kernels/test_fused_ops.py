"""Fused Triton RMSNorm / rotary (+ q/k norm) / SiLU-and-mul vs their torch references, the
references vs the layer math they replaced, and the layers' choice of implementation.

Without CUDA the kernels run in Triton's interpreter on small shapes (the unmarked tests, a few
seconds in all; fp32 and fp16: the interpreter mis-rounds bf16). The `gpu` tests sweep model
shapes in bf16/fp16/fp32, count how many bf16 elements differ from the reference (HF rounding),
and replay the ops from a CUDA graph.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
# Without CUDA, tests/conftest.py has put triton in interpreter mode before this import.

from minisgl.kernels.activation import silu_and_mul  # noqa: E402
from minisgl.kernels.activation_ref import silu_and_mul_ref, silu_and_mul_row_norm_ref  # noqa: E402
from minisgl.kernels.impl import KernelImpl  # noqa: E402
from minisgl.kernels.norm import _rms_norm_kernel, fused_add_rms_norm, rms_norm  # noqa: E402
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref, rms_scale_ref  # noqa: E402
from minisgl.kernels.rotary import qk_norm_rotary, rotary, rotary_store_kv  # noqa: E402
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref  # noqa: E402
from minisgl.layers.activation import SiluAndMul  # noqa: E402
from minisgl.layers.norm import RMSNorm  # noqa: E402
from minisgl.layers.rotary import RotaryEmbedding  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not CUDA and type(_rms_norm_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# (atol, rtol): about one ulp of the dtype at the outputs' magnitude (a few units).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 2e-3), torch.bfloat16: (3.2e-2, 1.6e-2)}
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _close(actual: torch.Tensor, expected: torch.Tensor, max_mismatch: float = 0.0) -> None:
    """Within one-ulp tolerance everywhere and, for 16-bit dtypes, bitwise equal except in at most
    `max_mismatch` of the elements (rounding-boundary cases from fp32 reduction order)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    atol, rtol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    if actual.dtype != torch.float32 and actual.numel() > 0:
        mismatch = (actual != expected).float().mean().item()
        assert mismatch <= max_mismatch, f"{mismatch:.2%} of elements differ from the reference"


def _qkv_views(
    tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the strided head views of one fused qkv buffer (as `SelfAttention` splits it)."""
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_dim, device=DEVICE).to(dtype)
    q_size, kv_size = num_q * head_dim, num_k * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return qkv, q.view(-1, num_q, head_dim), k.view(-1, num_k, head_dim), v.view(-1, num_k, head_dim)


def _tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(head_dim, max_positions, 1_000_000.0, None, impl="torch").to(DEVICE)
    return rope.cos, rope.sin


# --- the references are exactly the layer math they replaced (HF parity rests on it) ---


def _old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _old_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)
    sin = torch.cat([sin, sin], dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_equal_previous_layer_math(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(6, 40).to(dtype), torch.randn(6, 40).to(dtype)
    weight = torch.randn(40).to(dtype)
    assert torch.equal(rms_norm_ref(x, weight, 1e-6), _old_rms_norm(x, weight, 1e-6))
    normed, total = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual) and torch.equal(normed, _old_rms_norm(x + residual, weight, 1e-6))

    _, q, k, _ = _qkv_views(5, 4, 2, 16, dtype)
    cos, sin = _tables(64, 16)
    positions = torch.tensor([0, 3, 63, 7, 7])
    cos_t, sin_t = cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)
    q_rot, k_rot = rotary_ref(positions, q, k, cos, sin)
    assert torch.equal(q_rot, _old_rotate(q, cos_t, sin_t)) and torch.equal(k_rot, _old_rotate(k, cos_t, sin_t))
    qw, kw = torch.randn(16).to(dtype), torch.randn(16).to(dtype)
    q_rot, k_rot = qk_norm_rotary_ref(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-5)
    assert torch.equal(q_rot, _old_rotate(_old_rms_norm(q, qw, 1e-6), cos_t, sin_t))
    assert torch.equal(k_rot, _old_rotate(_old_rms_norm(k, kw, 1e-5), cos_t, sin_t))

    gate_up = torch.randn(3, 24).to(dtype)
    assert torch.equal(silu_and_mul_ref(gate_up), F.silu(gate_up[:, :12]) * gate_up[:, 12:])


# --- kernels vs references (interpreter on CPU) ---


def _check_norm(tokens: int, hidden: int, dtype: torch.dtype, max_mismatch: float = 0.0) -> None:
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    _close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), max_mismatch)
    normed, total = fused_add_rms_norm(x, residual, weight, 1e-6)
    normed_ref, total_ref = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(total, total_ref)  # one rounded add: exact
    _close(normed, normed_ref, max_mismatch)
    x_in, res_in = x.clone(), residual.clone()
    out, new_res = fused_add_rms_norm(x_in, res_in, weight, 1e-6, inplace=True)
    assert out is x_in and new_res is res_in
    assert torch.equal(new_res, total_ref)
    _close(out, normed_ref, max_mismatch)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (5, 96), (3, 72)])
def test_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    _check_norm(tokens, hidden, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_per_head_view(dtype: torch.dtype) -> None:
    """A [T, H, D] head view of a fused qkv buffer (strides that merge into no single row stride)."""
    torch.manual_seed(2)
    _, q, _, _ = _qkv_views(5, 3, 1, 32, dtype)
    weight = torch.randn(32, device=DEVICE).to(dtype)
    _close(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6))


def test_rms_norm_weight_dtype_promotes() -> None:
    """fp32 weight on fp16 input gives fp32, as `weight * x` does in the reference."""
    x = torch.randn(3, 64, device=DEVICE).half()
    weight = torch.randn(64, device=DEVICE)
    _close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def _check_rotary(
    tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype, norm: bool, max_mismatch: float = 0.0
) -> None:
    qkv, q, k, v = _qkv_views(tokens, num_q, num_k, head_dim, dtype)
    max_positions = 4096 if CUDA else 64
    cos, sin = _tables(max_positions, head_dim)
    positions = torch.randint(0, max_positions, (tokens,), device=DEVICE)
    args: tuple[object, ...] = ()
    if norm:
        qw = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
        kw = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
        args = (qw, kw, 1e-6, 1e-5)
    fused: Callable[..., tuple[torch.Tensor, torch.Tensor]] = qk_norm_rotary if norm else rotary
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]] = qk_norm_rotary_ref if norm else rotary_ref
    q_ref, k_ref = reference(positions, q, k, cos, sin, *args)
    for pos in (positions, positions.int()):
        q_out, k_out = fused(pos, q, k, cos, sin, *args)
        _close(q_out, q_ref, max_mismatch)
        _close(k_out, k_ref, max_mismatch)
    # Fused with the KV store: k (rotated) and v land in their cache slots, nothing else changes.
    slots = 3 * tokens + 5
    k_cache = torch.randn(slots, num_k, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(slots, num_k, head_dim, device=DEVICE).to(dtype)
    k_before, v_cache_before = k_cache.clone(), v_cache.clone()
    out_loc = torch.randperm(slots, device=DEVICE)[:tokens]
    norm_args = tuple(args) if norm else None
    q_out = rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, out_loc, norm_args)  # type: ignore[arg-type]
    _close(q_out, q_ref, max_mismatch)
    _close(k_cache[out_loc], k_ref, max_mismatch)
    assert torch.equal(v_cache[out_loc], v)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[out_loc] = False
    assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_cache_before[untouched])
    # With `row_norm`: q, k and v were projected from un-normalised hidden rows (the input norm's
    # weight folded into the projection) and first take each row's 1 / rms (rounded to dtype).
    hidden = (3 * torch.randn(tokens, 40, device=DEVICE)).to(dtype)  # 40: a masked tail
    scale = rms_scale_ref(hidden, 1e-6)[:, :, None]
    q_s, k_s, v_s = ((t.float() * scale).to(dtype) for t in (q, k, v))
    q_ref_s, k_ref_s = reference(positions, q_s, k_s, cos, sin, *args)
    q_out = rotary_store_kv(
        positions, q, k, v, cos, sin, k_cache, v_cache, out_loc, norm_args, (hidden, 1e-6)  # type: ignore[arg-type]
    )
    scaled_mismatch = max(max_mismatch, 0.05)  # 1 / rms summed in another order: rare one-ulp flips
    _close(q_out, q_ref_s, scaled_mismatch)
    _close(k_cache[out_loc], k_ref_s, scaled_mismatch)
    _close(v_cache[out_loc], v_s, scaled_mismatch)
    v_before = v.clone()
    q_out, k_out = fused(positions, q, k, cos, sin, *args, inplace=True)
    assert q_out is q and k_out is k and torch.equal(v, v_before)
    _close(q, q_ref, max_mismatch)
    _close(k, k_ref, max_mismatch)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens,num_q,num_k,head_dim", [(1, 4, 2, 16), (7, 3, 1, 64), (4, 9, 3, 24)])
def test_rotary(tokens: int, num_q: int, num_k: int, head_dim: int, norm: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    _check_rotary(tokens, num_q, num_k, head_dim, dtype, norm)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 48), (2, 1100)])
def test_silu_and_mul(tokens: int, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    x = (2 * torch.randn(tokens, 2 * inter, device=DEVICE)).to(dtype)
    # exp differs in the last fp32 bit between implementations: a rare fp16 rounding flip.
    _close(silu_and_mul(x), silu_and_mul_ref(x), max_mismatch=0.01)
    _close(silu_and_mul(x.view(1, tokens, 2 * inter)), silu_and_mul_ref(x.view(1, tokens, 2 * inter)), 0.01)
    # With `row_norm`: x projected from un-normalised rows takes each row's 1 / rms first.
    hidden = (3 * torch.randn(tokens, 40, device=DEVICE)).to(dtype)
    _close(silu_and_mul(x, (hidden, 1e-5)), silu_and_mul_row_norm_ref(x, hidden, 1e-5), max_mismatch=0.05)


def test_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert fused_add_rms_norm(x, x, torch.ones(64, device=DEVICE), 1e-6)[1].shape == (0, 64)
    assert silu_and_mul(x).shape == (0, 32)
    cos, sin = _tables(8, 16)
    q_out, k_out = rotary(torch.empty(0, dtype=torch.long, device=DEVICE), x.view(0, 4, 16), x.view(0, 4, 16), cos, sin)
    assert q_out.shape == k_out.shape == (0, 4, 16)


# --- the layers: choice of implementation and the wiring to the kernels ---


def test_layers_use_reference_on_cpu() -> None:
    with torch.device("cpu"):
        assert RMSNorm(16, 1e-6).impl == "torch"
        assert RotaryEmbedding(16, 32, 10000.0, None).impl == "torch"
        assert SiluAndMul().impl == "torch"


@needs_cuda
def test_layers_use_triton_on_cuda() -> None:
    from minisgl.platform import init_platform
    from minisgl.platform.kernel_config import KernelConfig

    platform = init_platform("cuda")  # the default kernel choices
    with torch.device("cuda"):
        assert RMSNorm(16, 1e-6).impl == "triton"
        assert RotaryEmbedding(16, 32, 10000.0, None).impl == "triton"
        assert SiluAndMul().impl == "triton"
    platform.use_kernels(KernelConfig(fused_kernels=False))  # --no-fused-kernels
    try:
        with torch.device("cuda"):
            assert RMSNorm(16, 1e-6).impl == "torch"
            assert RotaryEmbedding(16, 32, 10000.0, None).impl == "torch"
            assert SiluAndMul().impl == "torch"
    finally:
        platform.use_kernels(KernelConfig())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_layers_triton_equal_torch(dtype: torch.dtype) -> None:
    """Each layer with impl='triton' (interpreted on CPU) equals impl='torch' through its API."""
    torch.manual_seed(5)
    layers = {}
    impls: tuple[KernelImpl, ...] = ("triton", "torch")
    for impl in impls:
        with torch.device(DEVICE):
            norm, q_norm, k_norm = (RMSNorm(n, eps, impl=impl) for n, eps in ((48, 1e-6), (16, 1e-6), (16, 1e-5)))
            rope = RotaryEmbedding(16, 64, 10000.0, {"rope_type": "linear", "factor": 2.0}, impl=impl)
            act = SiluAndMul(impl=impl)
        for module, seed in ((norm, 6), (q_norm, 7), (k_norm, 8)):
            noise = torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(seed))
            module.weight.data = (1 + 0.1 * noise).to(DEVICE, dtype)
        layers[impl] = (norm, q_norm, k_norm, rope, act)
    x, residual = torch.randn(3, 48, device=DEVICE).to(dtype), torch.randn(3, 48, device=DEVICE).to(dtype)
    _, q, k, _ = _qkv_views(3, 4, 2, 16, dtype)
    positions = torch.tensor([5, 0, 63], device=DEVICE)
    results = {}
    for impl, (norm, q_norm, k_norm, rope, act) in layers.items():
        results[impl] = (
            norm(x), *norm(x, residual), *rope(positions, q, k),
            *rope.forward_qk_norm(positions, q, k, q_norm, k_norm), act(torch.cat([x, residual], dim=-1)),
        )  # fmt: skip
    for got, expected in zip(results["triton"], results["torch"]):
        _close(got, expected)


# --- GPU sweeps (bf16 included) and CUDA-graph replay ---


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("hidden", [576, 1024, 2048, 4096, 5120, 8192])
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_gpu_rms_norm_sweep(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(10)
    _check_norm(tokens, hidden, dtype, max_mismatch=0.01)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_q,num_k", [(16, 8), (32, 8), (9, 3), (64, 8)])
@pytest.mark.parametrize("tokens", [1, 5, 333, 4096])
def test_gpu_rotary_sweep(tokens: int, num_q: int, num_k: int, head_dim: int, norm: bool, dtype: torch.dtype) -> None:
    """Within one ulp of the reference everywhere (fp32: 1e-5). How many 16-bit elements sit one
    ulp apart is the next test's business."""
    torch.manual_seed(11)
    _check_rotary(tokens, num_q, num_k, head_dim, dtype, norm, max_mismatch=1.0)


@gpu
@needs_cuda
@pytest.mark.xfail(
    reason="known gap: compiled on an H200 the kernel does not reproduce eager torch's per-op 16-bit "
    "rounding (17-20% of bf16 elements one ulp apart; scripts/diag_rotary.py), though the "
    "interpreter does; end-to-end bf16 parity with HF still holds (tests/golden/test_gpu_parity.py)",
    strict=True,
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rotary_rounds_like_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    _check_rotary(333, 16, 8, 128, dtype, False, max_mismatch=0.001)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("inter", [1536, 3072, 14336])
@pytest.mark.parametrize("tokens", [1, 100, 2048])
def test_gpu_silu_and_mul_sweep(tokens: int, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(12)
    x = (2 * torch.randn(tokens, 2 * inter, device=DEVICE)).to(dtype)
    _close(silu_and_mul(x), silu_and_mul_ref(x), max_mismatch=0.01)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay() -> None:
    """All four ops captured in one CUDA graph, replayed on new inputs copied into the static ones."""
    torch.manual_seed(13)
    dtype, tokens, hidden, num_q, num_k, head_dim = torch.bfloat16, 4, 1024, 16, 8, 128
    cos, sin = _tables(4096, head_dim)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    qkv, q, k, _ = _qkv_views(tokens, num_q, num_k, head_dim, dtype)
    qw, kw = torch.randn(head_dim, device=DEVICE).to(dtype), torch.randn(head_dim, device=DEVICE).to(dtype)
    positions = torch.zeros(tokens, dtype=torch.long, device=DEVICE)
    gate_up = torch.randn(tokens, 2 * 3072, device=DEVICE).to(dtype)

    def step() -> tuple[torch.Tensor, ...]:
        normed, total = fused_add_rms_norm(x, residual, weight, 1e-6)
        q_out, k_out = qk_norm_rotary(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-6)
        return rms_norm(normed, weight, 1e-6), total, q_out, k_out, silu_and_mul(gate_up)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        for buf in (x, residual, qkv, gate_up):
            buf.copy_(torch.randn(buf.shape, device=DEVICE).to(dtype))
        positions.copy_(torch.randint(0, 4096, (tokens,), device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        # Replay equals the same kernels run eagerly on the new inputs, bit for bit.
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)
        normed_ref, total_ref = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
        q_ref, k_ref = qk_norm_rotary_ref(positions, q, k, cos, sin, qw, kw, 1e-6, 1e-6)
        # The second norm reads the first's output, whose own rounding flips may propagate.
        _close(outs[0], rms_norm_ref(normed_ref, weight, 1e-6), max_mismatch=0.02)
        for got, want in ((outs[1], total_ref), (outs[4], silu_and_mul_ref(gate_up))):
            _close(got, want, max_mismatch=0.01)
        for got, want in zip(outs[2:4], (q_ref, k_ref)):
            _close(got, want, max_mismatch=1.0)  # one ulp (see test_gpu_rotary_rounds_like_eager)
