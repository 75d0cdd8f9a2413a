"""Device facts, resolved once at start-up. Everything device-specific is asked here.

`minisgl.platform.kernel_config` is torch-free; the platforms themselves import torch, so this
package imports them only when a platform is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minisgl.platform.base import BasePlatform

_CURRENT: BasePlatform | None = None


def device_name(device: str) -> str:
    """`device` with "auto" resolved: "cuda" where torch sees a GPU, else "cpu"."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def init_platform(device: str = "auto") -> BasePlatform:
    """Resolve the platform for `device` ("auto", "cpu", "cuda", "cuda:N") and make it current."""
    global _CURRENT
    device = device_name(device)
    if device.startswith("cuda"):
        from minisgl.platform.cuda import CudaPlatform

        _CURRENT = CudaPlatform(device)
    elif device == "cpu":
        from minisgl.platform.cpu import CpuPlatform

        _CURRENT = CpuPlatform()
    else:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    return _CURRENT


def current() -> BasePlatform:
    if _CURRENT is None:
        return init_platform("auto")
    return _CURRENT


def compiles_triton(device: torch.device) -> bool:
    """Whether Triton kernels compile for tensors on `device` (CUDA); on the CPU they only run in
    Triton's interpreter, for tests."""
    return device.type == "cuda"


def pins_host_memory(device: torch.device) -> bool:
    """Whether host buffers copied to `device` are pinned, so the copies run asynchronously (CUDA)."""
    return device.type == "cuda"
