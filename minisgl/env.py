"""Typed environment switches. Every switch is read here, nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _opt_bool(name: str) -> bool | None:
    raw = os.environ.get(name)
    return None if raw is None or raw == "" else _bool(name, False)


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else int(raw)


@dataclass(frozen=True)
class Env:
    api_key: str | None  # the server's key when --api-key is not given
    cache_dir: Path
    disable_overlap: bool
    log_level: str
    num_threads: int  # 0: let torch decide
    triton_interpret: bool
    fused_kernels: bool
    pdl: bool
    cpu_kernels: bool
    cpu_attn_kernel: bool
    default_dtype: str | None
    fold_norms: bool
    triton_gemm: bool
    decode_tuned: bool
    pad_eager: bool | None

    @staticmethod
    def read() -> "Env":
        default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minisgl"
        return Env(
            api_key=os.environ.get("MINISGL_API_KEY") or None,
            cache_dir=Path(os.environ.get("MINISGL_CACHE_DIR", default_cache)),
            disable_overlap=_bool("MINISGL_DISABLE_OVERLAP", False),
            log_level=os.environ.get("MINISGL_LOG_LEVEL", "INFO").upper(),
            num_threads=_int("MINISGL_NUM_THREADS", 0),
            triton_interpret=_bool("TRITON_INTERPRET", False),
            # Fused Triton norm/rotary/SiLU/sampling kernels on CUDA (MINISGL_FUSED_KERNELS=0: the
            # torch references instead, for ablation).
            fused_kernels=_bool("MINISGL_FUSED_KERNELS", True),
            # Programmatic dependent launch of the Triton kernels on sm90+ (kernels/pdl.py).
            pdl=_bool("MINISGL_PDL", True),
            # The bf16 C++ CPU kernels (kernels/cpu_ops.py) and the C++ CPU decode attention
            # (kernels/cpu_attention.py); 0: the torch paths.
            cpu_kernels=_bool("MINISGL_CPU_KERNELS", True),
            cpu_attn_kernel=_bool("MINISGL_CPU_ATTN_KERNEL", True),
            # What `--dtype auto` means, overriding the platform's choice (e.g. float32 on CPU).
            default_dtype=os.environ.get("MINISGL_DEFAULT_DTYPE") or None,
            # Fold the RMSNorm weights into the qkv/gate_up projections where the Triton kernels
            # finish the norms (models/llama.py: DecoderLayer.forward_folded); 0: off.
            fold_norms=_bool("MINISGL_FOLD_NORMS", True),
            # The split-K Triton GEMM for o_proj/down_proj of the folded-norm layer where it measured
            # faster than cuBLAS (kernels/gemm.py: small decode batches); 0: cuBLAS only.
            triton_gemm=_bool("MINISGL_TRITON_GEMM", True),
            # The decode attention launches measured per captured batch size (kernels/attention.py:
            # GRAPH_TUNED); 0: every size takes the split-count heuristic and the default launch.
            decode_tuned=_bool("MINISGL_DECODE_TUNED", True),
            # Pad eager (prefill) steps' token and logits row counts to a few sizes, so cuBLAS
            # sees GEMM shapes it has seen before (engine/engine.py: padded_rows); unset: on CUDA.
            pad_eager=_opt_bool("MINISGL_PAD_EAGER"),
        )


ENV = Env.read()
