"""Device facts, resolved once at start-up. Everything device-specific is asked here."""

from __future__ import annotations

from minisgl.platform.base import BasePlatform

_CURRENT: BasePlatform | None = None


def init_platform(device: str = "auto") -> BasePlatform:
    """Resolve the platform for `device` ("auto", "cpu", "cuda", "cuda:N") and make it current."""
    global _CURRENT
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
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
