"""Which implementation of a fused op a layer runs: the Triton kernel or its plain-torch reference.

Layers ask once, in `__init__`, with the device their tensors live on, so the forward pass carries
no per-call dispatch and the CPU path never imports triton (it is a test extra, not a dependency).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

KernelImpl = Literal["auto", "triton", "torch"]


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: KernelImpl, device: torch.device) -> Literal["triton", "torch"]:
    """`auto`: Triton on CUDA when triton is installed (unless MINISGL_FUSED_KERNELS=0), the
    reference otherwise. The CPU default is the reference because the Triton interpreter is for tests only, far too slow to serve; tests
    ask for `triton` explicitly to run the interpreted kernels through the layers."""
    if impl == "torch":
        return "torch"
    if impl == "triton":
        if not triton_installed():
            raise ValueError("impl='triton' was asked for but triton is not installed")
        return "triton"
    from minisgl.env import ENV

    return "triton" if device.type == "cuda" and ENV.fused_kernels and triton_installed() else "torch"
