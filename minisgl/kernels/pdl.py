"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A replayed decode step is ~300 kernels; each boundary costs a launch gap in which the GPU idles.
On Hopper and newer GPUs a kernel launched with PDL is scheduled while its predecessor drains and
blocks in `gdc_wait` until that predecessor has completed and its writes are visible. Every
kernel here that takes the `PDL` flag calls `gdc_wait` before it touches memory, so ordering is
exactly as without PDL (also transitively: a predecessor cannot complete before its own wait
returned); only the launch latency overlaps the previous kernel's tail. CUDA graphs capture the
programmatic edges. Off: --no-pdl; never on CPU (the interpreter) or before sm90 (the platform's
`supports_pdl`, folded into its resolved `kernels.pdl`).
"""

from __future__ import annotations

import torch

from minisgl.platform import current


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel with a `PDL: tl.constexpr` parameter on tensors of `device`:
    the constexpr (wait or not) and Triton's `launch_pdl` launch option."""
    on = device.type == "cuda" and current().kernels.pdl
    return {"PDL": on, "launch_pdl": on}
