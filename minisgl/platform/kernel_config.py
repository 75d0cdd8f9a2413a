"""Which implementation the layers and kernels take where there is a choice: `KernelConfig`, one
field per `--x/--no-x` flag, and `resolve_kernels`, which turns off what a platform cannot run.

Torch-free, so that the command line (`server/args.py`) builds it without importing torch.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, replace
from typing import Literal, Protocol, get_args

# The code path of the quantized CPU kernels (kernels/cpu_quant.py; the C++ CPU ops may follow
# it too): "auto" takes the best the CPU runs; the others force one (AVX2 on an AVX-512 CPU, to
# measure what an AVX2-only machine gets; "portable": plain C++, any target).
CpuIsa = Literal["auto", "avx512", "avx2", "portable"]


class PlatformFacts(Protocol):
    """What `resolve_kernels` asks of a platform (platform/base.py implements it; a Protocol so
    this module needs no import of base.py, which imports it)."""

    name: Literal["cpu", "cuda"]

    @property
    def compiles_triton(self) -> bool: ...

    @property
    def supports_pdl(self) -> bool: ...


@dataclass(frozen=True)
class KernelConfig:
    """Each field is a wish (True: use it where it runs); `resolve_kernels` leaves it on only
    where the platform runs it, and the layers pick their implementation from the resolved one
    once, in `__init__`. All of them are for ablations and bisecting: the defaults are the
    measured-fastest configuration."""

    # Fused Triton norm/rotary/SiLU/sampling kernels on CUDA; off: the torch references.
    fused_kernels: bool = True
    # Programmatic dependent launch of the Triton kernels on sm90+ (kernels/pdl.py).
    pdl: bool = True
    # RMSNorm weights folded into the qkv/gate_up projections where the Triton kernels finish the
    # norms (models/llama.py: DecoderLayer.forward_folded); needs the triton attention backend.
    fold_norms: bool = True
    # The split-K Triton GEMM for o_proj/down_proj where it measured faster than cuBLAS
    # (kernels/gemm.py: small decode batches); off: cuBLAS only.
    triton_gemm: bool = True
    # The decode attention launches measured per captured batch size (kernels/tuned/); off: every
    # size takes the split-count heuristic and the default launch.
    decode_tuned: bool = True
    # The bf16 C++ CPU kernels (kernels/cpu_ops.py) and the C++ CPU decode attention
    # (kernels/cpu_attention.py); off: the torch paths. The kernels run for bf16; with
    # `cpu_kernels_fp32` the norms, rotary, SiLU and decode attention take them for fp32
    # activations too; None: on for GGUF weights kept quantized (engine/resolve.py: that run is
    # not bit-exact with transformers anyway), off for a float model, whose fp32 mode keeps the
    # torch references and the per-request SDPA path (the exact-parity mode).
    cpu_kernels: bool = True
    cpu_attn_kernel: bool = True
    cpu_kernels_fp32: bool | None = None
    # Not a switch: which ISA the CPU kernels run (`--cpu-isa`); checked against the CPU when the
    # kernels load, since only the built library knows what it can run.
    cpu_isa: CpuIsa = "auto"

    def __post_init__(self) -> None:
        if self.cpu_isa not in get_args(CpuIsa):
            raise ValueError(f"unknown cpu_isa {self.cpu_isa!r}: use one of {', '.join(get_args(CpuIsa))}")


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_kernels(kernels: KernelConfig, platform: PlatformFacts) -> KernelConfig:
    """`kernels` with every switch the platform cannot run turned off (pure: platform facts only)."""
    triton = platform.compiles_triton and triton_installed()
    on_cpu = platform.name == "cpu"
    return replace(
        kernels,
        fused_kernels=kernels.fused_kernels and triton,
        pdl=kernels.pdl and triton and platform.supports_pdl,
        triton_gemm=kernels.triton_gemm and triton,
        decode_tuned=kernels.decode_tuned and triton,
        cpu_kernels=kernels.cpu_kernels and on_cpu,
        cpu_attn_kernel=kernels.cpu_attn_kernel and on_cpu,
        cpu_kernels_fp32=bool(kernels.cpu_kernels_fp32) and (kernels.cpu_kernels or kernels.cpu_attn_kernel) and on_cpu,
    )
