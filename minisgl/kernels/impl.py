"""Which implementation of a fused op a layer runs: the Triton kernel, the bf16 CPU kernel
(`kernels/cpu_ops.py`) or the plain-torch reference.

Layers ask once, in `__init__`, with the device their tensors live on, so the forward pass carries
no per-call dispatch and the CPU path never imports triton (it is a test extra, not a dependency).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from minisgl.platform import current
from minisgl.platform.kernel_config import triton_installed

__all__ = ["KernelImpl", "num_sms", "resolve_impl", "triton_installed"]

KernelImpl = Literal["auto", "triton", "cpu", "torch"]


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors that Triton launches are sized for. Interpreter runs (CPU) get a
    small pretend machine, so that CPU tests still exercise several splits."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def resolve_impl(impl: KernelImpl, device: torch.device) -> Literal["triton", "cpu", "torch"]:
    """`auto`: Triton on CUDA when triton is installed (unless --no-fused-kernels); on CPU the C++
    kernels when the model is built in bf16 (the default dtype while the engine builds it) and
    they are available (unless --no-cpu-kernels), in fp32 when the engine sent fp32 to them
    (`cpu_ops.set_fp32`: GGUF weights kept quantized), else the reference. The switches are the
    platform's resolved kernel choices (`platform.kernels`, set by the engine). fp32 on CPU
    otherwise is the exact-parity mode: the reference. The Triton interpreter is for tests only, far too
    slow to serve; tests ask for `triton` explicitly to run the interpreted kernels."""
    if impl == "torch":
        return "torch"
    if impl == "cpu":
        return "cpu"
    if impl == "triton":
        if not triton_installed():
            raise ValueError("impl='triton' was asked for but triton is not installed")
        return "triton"
    if device.type == "cuda":
        return "triton" if current().kernels.fused_kernels else "torch"
    dtype = torch.get_default_dtype()
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        from minisgl.kernels import cpu_ops

        if dtype == torch.bfloat16:
            return "cpu" if cpu_ops.enabled() else "torch"
        return "cpu" if cpu_ops.takes(torch.float32) else "torch"  # set by the engine (cpu_kernels_fp32)
    return "torch"
