"""Layers over GGUF weights kept as their quantized blocks (`--weights gguf`, CPU, one rank).

The loader (models/gguf_weights.py) hands a linear layer its blocks (`quant_linear_fn`, given to
`ColumnParallelLinear.use_weight_fn` / `RowParallelLinear.use_weight_fn`) and puts
`QuantEmbedding` / `QuantLMHead` in place of the vocabulary layers. The activations stay fp32:
the kernels (kernels/cpu_quant.py) dequantize the weights in registers, so the output is the
dequantized model's up to summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernels.cpu_quant import QuantMatrix, QuantOp
from minisgl.layers.linear import LinearFn
from minisgl.platform import current


def quant_op() -> QuantOp:
    """The kernels on the platform's `--cpu-isa` path (chosen once per layer, at load)."""
    return QuantOp(current().kernels.cpu_isa)


class QuantLinearFn:
    """A `LinearFn` whose weight is held here, as one or more row blocks of W (q|k|v parts of
    different quant types stay separate matrices; equal types are concatenated by the loader).
    The `weight` argument (the layer's emptied float parameter) is not read."""

    def __init__(self, parts: list[QuantMatrix], op: QuantOp) -> None:
        assert parts and len({qm.k for qm in parts}) == 1, "the parts of one projection share its input size"
        self.parts = parts
        self.op = op
        self.out_features = sum(qm.n for qm in parts)
        self.nbytes = sum(qm.weight.numel() for qm in parts)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if len(self.parts) == 1:
            out = self.op.linear(x, self.parts[0])
        else:
            out = torch.cat([self.op.linear(x, qm) for qm in self.parts], dim=-1)
        return out if bias is None else out + bias


class QuantEmbedding(nn.Module):
    """Token embedding looked up from the blocks: only the rows of this step's tokens are
    dequantized (the table stays at its file size; Q8_0: 1.06 bytes a weight instead of 4)."""

    def __init__(self, qm: QuantMatrix, vocab_size: int, op: QuantOp) -> None:
        super().__init__()
        if qm.n != vocab_size:
            raise ValueError(f"embedding of {qm.n} rows, the config's vocabulary is {vocab_size}")
        self.qm, self.op, self.vocab_size = qm, op, vocab_size
        self.register_buffer("blocks", qm.weight, persistent=False)  # listed in the module's buffers

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.op.rows(self.qm, input_ids)


class QuantLMHead(nn.Module):
    """The output projection over the blocks (the embedding's, when the model ties them)."""

    def __init__(self, qm: QuantMatrix, vocab_size: int, op: QuantOp) -> None:
        super().__init__()
        if qm.n < vocab_size:
            raise ValueError(f"LM head of {qm.n} rows, the config's vocabulary is {vocab_size}")
        self.vocab_size = vocab_size
        self._linear: LinearFn = QuantLinearFn([qm], op)
        self.register_buffer("blocks", qm.weight, persistent=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._linear(hidden)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
