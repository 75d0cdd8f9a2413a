"""Linear layers over 4-bit weights (AWQ, GPTQ, compressed-tensors int4: models/w4_weights.py).

The loader hands a linear layer its packed weight as `W4LinearFn` (through `use_weight_fn`, as
the GGUF blocks are: layers/quant.py). Activations stay in the model's dtype (W4A16): on CUDA the
Triton dequant-GEMM (kernels/w4_gemm.py) unpacks the nibbles in registers; elsewhere the
reference dequantizes the layer's weight for the call and multiplies (kernels/w4_ref.py).
"""

from __future__ import annotations

from typing import Literal

import torch

from minisgl.kernels.impl import resolve_impl
from minisgl.kernels.w4_ref import W4Weight, w4_linear_ref

W4Impl = Literal["auto", "triton", "torch"]


class W4LinearFn:
    """A `LinearFn` holding one or more output blocks of W (q|k|v or gate|up parts joined where
    their groups agree, kernels/w4_ref.py: `concat_outputs`). The layer's emptied float parameter
    passed as `weight` is not read."""

    def __init__(self, parts: list[W4Weight], impl: W4Impl = "auto") -> None:
        assert parts and len({p.in_features for p in parts}) == 1, "the parts of one projection share its input size"
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        device = parts[0].qweight.device
        chosen = resolve_impl("auto" if impl == "auto" else impl, device)
        if chosen == "triton":
            from minisgl.kernels.w4_gemm import w4_gemm

            self._matmul = w4_gemm
        else:  # the CPU kernels have no 4-bit path: the reference
            self._matmul = w4_linear_ref
        self.impl = "triton" if chosen == "triton" else "torch"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if len(self.parts) == 1:
            out = self._matmul(x, self.parts[0])
        else:
            out = torch.cat([self._matmul(x, part) for part in self.parts], dim=-1)
        return out if bias is None else out + bias
