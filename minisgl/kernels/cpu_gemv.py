"""One-token matmuls on CPU in bf16: `y = W x` as a streamed reduction compiled by Inductor.

Decoding a single request on CPU reads every weight once per token, so its speed is memory
bandwidth. oneDNN/MKL's bf16 GEMV streams a 212 MB set of SmolLM2 layer weights at ~14 GB/s on
the 2-core CI machine; the same product written as `(W * x).sum(-1)` in fp32 and compiled by
torch.compile (a vectorised C++ loop, no temporary) streams at ~22 GB/s (scripts/cpu_gemv_bench.py).
Only rows == 1 take this path (batched rows are compute-bound: the GEMM library wins there), and
only bf16: in fp32 the library's summation order is kept, so fp32 stays the exact-parity mode.

Compiled once per weight shape (a few per model, seconds each; Inductor caches them on disk).
Without a working compiler the first call logs why and every later call uses `F.linear`.
Turn off with MINISGL_CPU_GEMV=0.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

_compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
_broken = os.environ.get("MINISGL_CPU_GEMV", "1").strip().lower() in ("0", "false", "no", "off")


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K], weight [N, K] -> [1, N] in weight's dtype, accumulated in fp32."""
    return (weight.float() * x.float()).sum(dim=-1, keepdim=False).to(weight.dtype).unsqueeze(0)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        not _broken
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] == 1
        and weight.dtype == torch.bfloat16
        and x.dtype == torch.bfloat16
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the compiled GEMV where it applies (see the module docstring)."""
    global _compiled, _broken
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    if _compiled is None:
        import torch._dynamo

        # One specialisation per weight shape; past dynamo's default limit (8) it would silently
        # run `_gemv` eagerly, materialising W * x. A model has a handful of shapes.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(_gemv, dynamic=False, fullgraph=True)
    try:
        out = _compiled(x, weight)
    except Exception as exc:  # no C++ compiler, an Inductor bug: serve on, just slower
        _broken = True
        logger.warning("compiled CPU GEMV unavailable (%s: %s); using F.linear", type(exc).__name__, exc)
        return F.linear(x, weight, bias)
    return out if bias is None else out + bias


def warm_up(model: torch.nn.Module) -> int:
    """Compile the GEMV for every distinct weight shape of `model`'s linear layers and LM head now
    (at engine start) rather than inside the first request. Returns how many shapes it compiled."""
    from minisgl.layers.embedding import ParallelLMHead
    from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear

    shapes: dict[tuple[int, int], torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            shapes.setdefault(tuple(module.weight.shape), module.weight)  # type: ignore[arg-type]
    done = 0
    with torch.inference_mode():
        for (_, k), weight in shapes.items():
            x = torch.zeros(1, k, dtype=weight.dtype, device=weight.device)
            if applies(x, weight):
                linear(x, weight)
                done += 0 if _broken else 1
    return done
