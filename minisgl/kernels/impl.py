"""Which implementation of a fused op a layer runs: the Triton kernel, the bf16 CPU kernel
(`kernels/cpu_ops.py`) or the plain-torch reference.

Layers ask once, in `__init__`, with the device their tensors live on, so the forward pass carries
no per-call dispatch and the CPU path never imports triton (it is a test extra, not a dependency).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

KernelImpl = Literal["auto", "triton", "cpu", "torch"]


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors that Triton launches are sized for. Interpreter runs (CPU) get a
    small pretend machine, so that CPU tests still exercise several splits."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: KernelImpl, device: torch.device) -> Literal["triton", "cpu", "torch"]:
    """`auto`: Triton on CUDA when triton is installed (unless MINISGL_FUSED_KERNELS=0); on CPU
    the C++ kernels when the model is built in bf16 (the default dtype while the engine builds it)
    and they are available (unless MINISGL_CPU_KERNELS=0), else the reference. fp32 on CPU is the
    exact-parity mode: always the reference. The Triton interpreter is for tests only, far too
    slow to serve; tests ask for `triton` explicitly to run the interpreted kernels."""
    if impl == "torch":
        return "torch"
    if impl == "cpu":
        return "cpu"
    if impl == "triton":
        if not triton_installed():
            raise ValueError("impl='triton' was asked for but triton is not installed")
        return "triton"
    from minisgl.env import ENV

    if device.type == "cuda":
        return "triton" if ENV.fused_kernels and triton_installed() else "torch"
    if device.type == "cpu" and torch.get_default_dtype() == torch.bfloat16:
        from minisgl.kernels import cpu_ops

        return "cpu" if cpu_ops.enabled() else "torch"
    return "torch"
