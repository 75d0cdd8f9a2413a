"""The compiled one-token CPU matmul: within bf16 rounding of the fp32 product, and taken only
where it applies (one row, bf16, CPU); everything else is exactly `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_gemv


def test_one_bf16_row_matches_the_fp32_product_within_rounding() -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 96).to(torch.bfloat16)
    x = torch.randn(1, 96).to(torch.bfloat16)
    bias = torch.randn(300).to(torch.bfloat16)
    assert cpu_gemv.applies(x, weight)
    exact = F.linear(x.float(), weight.float())
    out = cpu_gemv.linear(x, weight)
    assert out.shape == (1, 300) and out.dtype == torch.bfloat16
    # One rounding of the fp32 sum: within half a bf16 ulp (2^-8 relative) of the exact product.
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    # A second shape (another specialisation) and the bias.
    w2 = torch.randn(17, 40).to(torch.bfloat16)
    x2 = torch.randn(1, 40).to(torch.bfloat16)
    torch.testing.assert_close(cpu_gemv.linear(x2, w2, bias[:17]).float(), F.linear(x2.float(), w2.float(), bias[:17].float()), atol=0.05, rtol=2**-7)


def test_other_cases_are_plain_linear() -> None:
    torch.manual_seed(1)
    w16 = torch.randn(64, 32).to(torch.bfloat16)
    rows = torch.randn(3, 32).to(torch.bfloat16)
    assert not cpu_gemv.applies(rows, w16)
    assert torch.equal(cpu_gemv.linear(rows, w16), F.linear(rows, w16))
    w32, x32 = torch.randn(64, 32), torch.randn(1, 32)
    assert not cpu_gemv.applies(x32, w32)  # fp32 keeps the library's summation order (exact parity)
    assert torch.equal(cpu_gemv.linear(x32, w32), F.linear(x32, w32))
