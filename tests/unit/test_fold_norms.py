"""Folded RMSNorms (`DecoderLayer.forward_folded`): the norm weights multiplied into the qkv and
gate_up projections, each row's 1 / rms applied by the rotary and SiLU kernels, the residual added
by o_proj and down_proj themselves. Through the whole engine (Triton kernels interpreted on CPU,
fp32) it computes what the unfolded layers do."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kernels.impl import triton_installed
from minisgl.layers import activation, norm, rotary
from minisgl.platform.kernel_config import KernelConfig
from tests.engine_helpers import forward_logits
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not triton_installed(), reason="needs triton (interpreted on CPU)")


def _force_layer_impl(monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    for module in (norm, activation, rotary):
        monkeypatch.setattr(module, "resolve_impl", lambda _impl, _device: impl)


@pytest.fixture
def triton_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers built from here on take the Triton kernels, as on CUDA (the interpreter on CPU)."""
    _force_layer_impl(monkeypatch, "triton")


def _engine(path: str, fold: bool, monkeypatch: pytest.MonkeyPatch) -> Engine:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Engine(EngineConfig(model=path, device=device, dtype="float32", attn="triton", page_size=4,
                               num_pages=256, max_running_requests=4, cuda_graph_max_bs=0,
                               kernels=KernelConfig(fold_norms=fold)))  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # with and without Qwen3's q/k norms
def test_folded_norms_equal_unfolded(arch: str, tmp_path, triton_layers, monkeypatch) -> None:
    make_tiny_model(arch, tmp_path)
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 3, 17)]
    folded = _engine(str(tmp_path), True, monkeypatch)
    plain = _engine(str(tmp_path), False, monkeypatch)
    assert folded.model.model.norms_folded and not plain.model.model.norms_folded
    got = forward_logits(folded, prompts, all_positions=True)
    expected = forward_logits(plain, prompts, all_positions=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), e.argmax(-1))


def test_not_folded_with_torch_kernels(tmp_path, monkeypatch) -> None:
    """The torch kernels cannot apply the row scale."""
    _force_layer_impl(monkeypatch, "torch")
    make_tiny_model("qwen3", tmp_path)
    assert not _engine(str(tmp_path), True, monkeypatch).model.model.norms_folded


def test_not_folded_with_qkv_bias(tmp_path, triton_layers, monkeypatch) -> None:
    """Qwen2's qkv bias would take the row scale too."""
    make_tiny_model("qwen2", tmp_path)
    assert not _engine(str(tmp_path), True, monkeypatch).model.model.norms_folded
