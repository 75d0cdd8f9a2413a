"""The float8 scale `amax / 448` is correctly rounded on every device: the reference
(`fp8_ref.amax_scale`) must equal the Triton quantizer's `div_rn`, and CUDA torch divides by a
Python scalar as a multiply by its fp32 reciprocal (1 ulp off for some amax: the H200 run of
tests/kernels/test_fp8_weights_gpu.py saw it). The fp64 quotient rounded to fp32 is the correctly
rounded fp32 quotient (53 >= 2 * 24 + 2 bits), so it is the oracle."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernels.fp8_ref import FP8_MAX, MIN_SCALE, amax_scale, quantize_fp8, quantize_weight_blocks

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])]


def _random_amax(device: str) -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.rand(100_000, device=device) * torch.logspace(-8, 3, 100_000, device=device)).float()


@pytest.mark.parametrize("device", DEVICES)
def test_amax_scale_is_the_correctly_rounded_quotient(device: str) -> None:
    amax = _random_amax(device)
    oracle = (amax.double() / FP8_MAX).float().clamp_min(MIN_SCALE)
    assert torch.equal(amax_scale(amax), oracle)
    assert torch.equal(amax_scale(torch.zeros(3, device=device)), torch.full((3,), MIN_SCALE, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_reference_quantizers_use_the_correctly_rounded_scale(device: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 256, device=device) * torch.logspace(-4, 2, 256, device=device)
    for group in (None, 128):
        _, scale = quantize_fp8(x, group)
        amax = x.abs().amax(-1, keepdim=True) if group is None else x.abs().unflatten(-1, (2, 128)).amax(-1)
        assert torch.equal(scale, (amax.double() / FP8_MAX).float().clamp_min(MIN_SCALE))
    _, blocks = quantize_weight_blocks(x, (32, 128))
    amax = x.abs().unflatten(0, (2, 32)).unflatten(-1, (2, 128)).amax(dim=(1, 3))
    assert torch.equal(blocks, (amax.double() / FP8_MAX).float().clamp_min(MIN_SCALE))
