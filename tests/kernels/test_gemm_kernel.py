"""Split-K Triton GEMM (`kernels/gemm.py`) against torch's matmul (its reference).

Without CUDA the kernel runs in Triton's interpreter on small shapes (fp32 and fp16: the
interpreter mis-rounds bf16 in tl.dot); the `gpu` tests run the model's decode shapes in bf16,
from a CUDA graph too (the per-tile counters must be back at zero after every call).
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels import gemm  # noqa: E402
from minisgl.kernels.arrival import arrival_counters  # noqa: E402
from minisgl.kernels.gemm import GemmConfig, default_config, splitk_gemm, supports  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA and type(gemm._splitk_gemm_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _counters_zero(device: torch.device) -> bool:
    return int(arrival_counters(device).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (5, 96, 512), (37, 64, 256)])
@pytest.mark.parametrize("split", [1, 2, 4])
def test_matches_matmul_in_interpreter(dtype: torch.dtype, M: int, N: int, K: int, split: int) -> None:
    torch.manual_seed(M * 7 + split)
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    residual = torch.randn(M, N).to(dtype)
    cfg = GemmConfig(16, 32, 64, split, 4, 2)
    ref = x.float() @ w.float().T
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=4e-3, rtol=2e-3)

    torch.testing.assert_close(splitk_gemm(x, w, config=cfg).float(), ref, **tol)
    # Out of place with a residual: the residual is left as it was.
    before = residual.clone()
    out = splitk_gemm(x, w, residual=residual, config=cfg)
    torch.testing.assert_close(out.float(), ref + before.float(), **tol)
    assert torch.equal(residual, before)
    # In place: out is the residual, as in the folded-norm layer.
    same = splitk_gemm(x, w, residual=residual, out=residual, config=cfg)
    assert same.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual, out, atol=0, rtol=0)
    assert _counters_zero(x.device)


def test_split_sum_is_deterministic_in_interpreter() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(20, 512), torch.randn(64, 512) / 512**0.5
    cfg = GemmConfig(16, 32, 64, 8, 4, 2)
    first = splitk_gemm(x, w, config=cfg)
    assert torch.equal(first, splitk_gemm(x, w, config=cfg))


def test_supports_and_default_config() -> None:
    x = torch.zeros(8, 1024)
    assert supports(x, torch.zeros(1024, 1024))
    assert not supports(torch.zeros(gemm.MAX_ROWS + 1, 1024), torch.zeros(1024, 1024))  # prefill: cuBLAS
    assert not supports(x, torch.zeros(1024, 1000))  # K not a multiple of 64
    assert not supports(x, torch.zeros(1000, 1024))  # N not a multiple of 32
    assert not supports(x, torch.zeros(1024, 1024, dtype=torch.float16))
    assert not supports(torch.zeros(8, 2048)[:, ::2], torch.zeros(1024, 1024))
    # Every decode size of Qwen3-0.6B's and Qwen3-8B's projections gets a launch that divides.
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 4096), (24576, 4096),
              (4096, 12288)]  # fmt: skip
    for (N, K), M in itertools.product(shapes, range(1, gemm.MAX_ROWS + 1)):
        for device in (torch.device("cpu"),) + ((torch.device("cuda"),) if CUDA else ()):
            cfg = default_config(M, N, K, device)
            assert N % cfg.block_n == 0 and K % (cfg.block_k * cfg.split_k) == 0, (M, N, K, cfg)


def test_tuned_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/tuned/splitk_gemm.json, on the device it was measured on (the tensors' device is
    pretended to be an H200: only its name is read); other devices keep cuBLAS."""
    assert gemm.TUNED, "kernels/tuned/splitk_gemm.json lists no launch"
    for (device, N, K), entries in gemm.TUNED.items():
        assert device.startswith("NVIDIA ")
        assert [m for m, _ in entries] == sorted(m for m, _ in entries)
        for max_rows, cfg in entries:
            assert max_rows <= gemm.MAX_ROWS and N % cfg.block_n == 0 and K % (cfg.block_k * cfg.split_k) == 0
            monkeypatch.setattr(gemm, "device_name", lambda _device, name=device: name)
            assert gemm.tuned_config(max_rows, N, K, torch.device("cpu")) is not None
    monkeypatch.setattr(gemm, "device_name", lambda _device: "NVIDIA H200")
    largest = max(m for m, _ in gemm.TUNED["NVIDIA H200", 1024, 2048])
    assert gemm.pays(torch.zeros(largest, 2048), torch.zeros(1024, 2048))
    assert not gemm.pays(torch.zeros(largest + 1, 2048), torch.zeros(1024, 2048))  # cuBLAS measured faster
    assert not gemm.pays(torch.zeros(8, 1024), torch.zeros(4096, 1024))  # not in the table
    monkeypatch.setattr(gemm, "device_name", lambda _device: "NVIDIA A100-SXM4-80GB")
    assert not gemm.pays(torch.zeros(largest, 2048), torch.zeros(1024, 2048))  # not measured there


def test_add_linear_matches_addmm_on_cpu() -> None:
    from minisgl.layers.linear import RowParallelLinear, add_linear_

    torch.manual_seed(1)
    x, w, r = torch.randn(6, 128), torch.randn(32, 128), torch.randn(6, 32)
    expected = r.clone().addmm_(x, w.t())
    out = add_linear_(r, x, w)
    assert out.data_ptr() == r.data_ptr() and torch.equal(r, expected)
    # The layer's choice, made once: never the split-K kernel where Triton does not compile.
    layer = RowParallelLinear(128, 32)
    assert layer._splitk is False
    layer.weight.data.copy_(w)
    r2 = expected.clone()
    assert layer.add_to_(r2, x).data_ptr() == r2.data_ptr() and torch.equal(r2, expected.addmm_(x, w.t()))


@gpu
@needs_cuda
@pytest.mark.parametrize("N,K", [(1024, 2048), (1024, 3072), (4096, 1024), (6144, 1024), (4096, 12288)])
@pytest.mark.parametrize("M", [1, 3, 16, 64, 160, 256])
def test_model_shapes_on_gpu(N: int, K: int, M: int) -> None:
    torch.manual_seed(M)
    dev = torch.device("cuda")
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
    residual = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    exact = x.float() @ w.float().T + residual.float()
    cublas = residual.clone().addmm_(x, w.t())
    out = splitk_gemm(x, w, residual=residual.clone(), out=None)
    ours = splitk_gemm(x, w, residual=residual)  # out of place
    assert torch.equal(out, ours)  # deterministic
    # At least as close to the exact sum as cuBLAS: ours rounds once, from the fp32 sum (on the
    # H200 ~29% of elements differ from cuBLAS by an ulp, and cuBLAS's error is the larger one).
    err, cublas_err = (ours.float() - exact).abs(), (cublas.float() - exact).abs()
    assert err.max().item() <= max(cublas_err.max().item() * 1.5, 1e-2)
    assert err.mean().item() <= cublas_err.mean().item() * 1.05
    assert _counters_zero(dev)


@gpu
@needs_cuda
def test_graph_replay_on_gpu() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(160, 3072, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(1024, 3072, device=dev) / 3072**0.5).bfloat16()
    hidden = torch.zeros(160, 1024, device=dev, dtype=torch.bfloat16)
    cfg = default_config(160, 1024, 3072, dev)
    assert cfg.split_k > 1  # the counters are exercised
    splitk_gemm(x, w, residual=hidden, out=hidden)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        splitk_gemm(x, w, residual=hidden, out=hidden)
    hidden.zero_()
    expected = torch.zeros_like(hidden)
    for _ in range(3):
        graph.replay()
        expected = splitk_gemm(x, w, residual=expected)
    torch.cuda.synchronize()
    assert torch.equal(hidden, expected)
    assert _counters_zero(dev)
