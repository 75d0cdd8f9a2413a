"""`resolve(config, platform)`: the engine's auto choices made once, for a platform; the kernel
switches a platform cannot run turned off (a pretend CUDA platform stands in for a GPU here)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import minisgl.platform.kernel_config as kernel_config
from minisgl.engine.config import EngineConfig
from minisgl.engine.resolve import resolve
from minisgl.platform.base import BasePlatform
from minisgl.platform.cpu import CpuPlatform
from minisgl.platform.kernel_config import KernelConfig, resolve_kernels


class _PretendGpu(BasePlatform):
    """The facts a CUDA platform states, without a device."""

    name = "cuda"
    dist_backend = "nccl"
    supports_graphs = True
    pin_memory = True
    default_attn = "triton"
    default_dtype = torch.bfloat16
    compiles_triton = True
    pad_eager = True

    def __init__(self, supports_pdl: bool = True) -> None:
        self.device = torch.device("cuda", 0)
        self.supports_pdl = supports_pdl

    def new_stream(self) -> Any: ...
    def new_event(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def stream_context(self, stream: Any) -> Any: ...
    def free_memory(self) -> int:
        return 0

    def kv_budget(self, memory_fraction: float) -> int:
        return 0

    def synchronize(self) -> None: ...


def test_gpu_defaults(monkeypatch) -> None:
    monkeypatch.setattr(kernel_config, "triton_installed", lambda: True)
    config = EngineConfig()
    resolved = resolve(config, _PretendGpu())
    assert (resolved.dtype, resolved.attn, resolved.pad_eager) == ("bfloat16", "triton", True)
    assert resolved.kernels == replace(KernelConfig(), cpu_kernels=False, cpu_attn_kernel=False, cpu_kernels_fp32=False)
    assert config.dtype == "auto" and config.kernels == KernelConfig()  # a new object: the input stays
    assert resolve(resolved, _PretendGpu()) == resolved  # resolving twice changes nothing
    # Before sm90: no PDL. The torch backend: nothing to fold the norms into.
    assert resolve(config, _PretendGpu(supports_pdl=False)).kernels.pdl is False
    torch_attn = resolve(replace(config, attn="torch", dtype="float16", pad_eager=False), _PretendGpu())
    assert (torch_attn.attn, torch_attn.dtype, torch_attn.pad_eager, torch_attn.kernels.fold_norms) == (
        "torch", "float16", False, False)  # fmt: skip
    # Each switch turned off stays off (cpu_isa is a choice, not a switch: test_cpu_isa_choice).
    for name in (f for f in KernelConfig.__dataclass_fields__ if f != "cpu_isa"):
        off = resolve(replace(config, kernels=replace(KernelConfig(), **{name: False})), _PretendGpu())
        assert getattr(off.kernels, name) is False, name


def test_gpu_without_triton(monkeypatch) -> None:
    monkeypatch.setattr(kernel_config, "triton_installed", lambda: False)
    kernels = resolve_kernels(KernelConfig(), _PretendGpu())
    assert not (kernels.fused_kernels or kernels.pdl or kernels.triton_gemm or kernels.decode_tuned)


def test_cpu_defaults() -> None:
    cpu = CpuPlatform()
    resolved = resolve(EngineConfig(device="cpu"), cpu)
    assert resolved.attn == "torch" and resolved.pad_eager is False
    assert resolved.dtype == str(cpu.default_dtype).removeprefix("torch.")
    # The embedded model's GGUF blocks stay quantized: its fp32 decode attention takes the C++ kernel.
    assert resolved.kernels == KernelConfig(fused_kernels=False, pdl=False, fold_norms=False, triton_gemm=False,
                                            decode_tuned=False, cpu_kernels_fp32=True)  # fmt: skip
    off = resolve(EngineConfig(device="cpu", kernels=KernelConfig(cpu_kernels=False, cpu_attn_kernel=False)), cpu)
    assert not (off.kernels.cpu_kernels or off.kernels.cpu_attn_kernel)


def test_platform_kernels_are_resolved() -> None:
    cpu = CpuPlatform()
    assert cpu.kernels == resolve_kernels(KernelConfig(), cpu)  # before any engine: the defaults
    cpu.use_kernels(KernelConfig(cpu_kernels=False, pdl=True))
    assert cpu.kernels.cpu_kernels is False and cpu.kernels.pdl is False  # no PDL on a CPU


def test_cpu_kernel_switches_reach_the_layers(tmp_path) -> None:
    """bf16 on CPU: the C++ kernels by default (where they build), the torch paths when switched off."""
    import pytest

    from minisgl.engine.engine import Engine
    from minisgl.kernels import cpu_attention, cpu_ops
    from minisgl.layers.norm import RMSNorm
    from minisgl.platform import init_platform
    from tests.tiny_models import make_tiny_model

    make_tiny_model("llama", tmp_path)

    def build(kernels: KernelConfig) -> tuple[set[str], bool]:
        engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="bfloat16", page_size=4, num_pages=16,
                                     max_running_requests=2, kernels=kernels))  # fmt: skip
        impls = {m.impl for m in engine.model.modules() if isinstance(m, RMSNorm)}
        return impls, engine.attn_backend.cpu_kernel  # type: ignore[attr-defined]

    try:
        assert build(KernelConfig(cpu_kernels=False, cpu_attn_kernel=False)) == ({"torch"}, False)
        assert cpu_ops.load() is None and cpu_attention.load() is None  # switched off: not even loaded
        init_platform("cpu")
        if cpu_ops.load() is None or cpu_attention.load() is None:
            pytest.skip("the C++ CPU kernels do not build here")
        assert build(KernelConfig()) == ({"cpu"}, True)
    finally:
        init_platform("cpu")  # the default kernel choices for the tests after this one
