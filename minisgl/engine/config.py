from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from minisgl.platform.kernel_config import KernelConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]
# How a GGUF model's weights are held. "gguf": the linear layers (and the embedding / LM head)
# keep the file's quantized blocks and multiply with fp32 activations through the quantized CPU
# kernels (TP=1, CPU); "float32" / "bfloat16": every tensor dequantized, the model in that dtype
# (float32: the exact-vs-Hugging Face mode). "auto": gguf for a .gguf model (or the embedded one)
# on CPU at one rank with --dtype auto and real weights; else the dtype's (an explicit --dtype
# float32 is the dequantized fp32 model, as before). Resolved, it is "gguf" or the model's dtype.
Weights = Literal["auto", "gguf", "float32", "bfloat16", "float16"]
# KV pages: see EngineConfig.kv_cache_dtype.
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3"]
# Weight quantization: "auto" = the checkpoint's (its quantization_config; float weights stay
# float); "fp8" = float8 W8A8, a float checkpoint quantized at load (per-channel weight scales,
# per-token activation scales; models/quant_fp8.py); "fp8_block" = the same with 128x128 weight
# blocks and per-token, per-128-column activation scales (the layout of Qwen3-*-FP8 / DeepSeek-V3).
Quantization = Literal["auto", "fp8", "fp8_block"]
# What the engine serves: text generation, or embeddings (models/pooling.py); auto: the checkpoint says.
EngineTask = Literal["auto", "generate", "embed"]


@dataclass(frozen=True)
class EngineConfig:
    """What the engine (model runner) needs. `auto` and None fields are filled in once, by
    `engine.resolve.resolve(config, platform)`, before the engine reads them."""

    model: str | None = None  # None: the embedded default model
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: DType = "auto"  # auto: the platform's (bf16 on CUDA and on CPUs with native bf16)
    weights: Weights = "auto"  # see Weights
    page_size: int = 16
    num_pages: int | None = None  # None: derived from memory_fraction / kv_cache_gb
    kv_cache_gb: float | None = None  # explicit KV budget (GiB); wins over memory_fraction
    # KV pool element type: "auto" = the model dtype, but fp16 for GGUF weights kept quantized on
    # CPU (fp32 math over 16-bit pages: kvcache/pool.py resolve_kv_dtype); "float32" / "bfloat16" /
    # "float16" = pages of that type (another than the model's: the torch attention backend);
    # "fp8_e4m3" = float8 pages with per-layer scales (the checkpoint's, else 1.0): half the bytes
    # of bf16, twice the tokens per GiB.
    kv_cache_dtype: KVCacheDType = "auto"
    quantization: Quantization = "auto"  # see Quantization
    # float8 KV without scales in the checkpoint: measure them at start (engine/kv_scales.py);
    # False: every scale 1.0 (vLLM's default).
    calculate_kv_scales: bool = True
    memory_fraction: float = 0.85  # fraction of free device memory (CUDA) the engine may hold
    dummy_weights: bool = False
    attn: str | None = None  # attention backend name; None: platform default
    tp_rank: int = 0
    tp_size: int = 1
    cuda_graph_max_bs: int = 256  # 0 disables CUDA graphs
    max_running_requests: int = 256  # rows of the token table
    # Decode entries one request may hold in a step: 1, or 1 + K with speculative decoding (a verify
    # row, engine/speculative.py; build_scheduler sets it). The CUDA graphs are captured up to
    # max_running_requests times this (at most cuda_graph_max_bs).
    decode_entries_per_request: int = 1
    max_model_len: int | None = None  # cap on the model's context length
    seed: int = 0
    # Pad eager (prefill) steps' token and logits row counts to a few sizes, so cuBLAS sees GEMM
    # shapes it has seen before (engine/engine.py: padded_rows). None: the platform's choice (CUDA).
    pad_eager: bool | None = None
    kernels: KernelConfig = field(default_factory=KernelConfig)
    # The server's scheduler processes start with glibc's malloc backing large blocks by
    # transparent huge pages (GLIBC_TUNABLES glibc.malloc.hugetlb=1, read by glibc only at process
    # start, so an in-process `LLM` gets it only from its own environment): a CPU forward's
    # activations then fault in 2 MiB at a time instead of 4 KiB (utils/memory.huge_page_environment).
    huge_pages: bool = True
    task: EngineTask = "auto"
    # Multi-LoRA (lora/): adapters loaded at start, as (name, path); LoRA is on with any of them or
    # with `enable_lora` (adapters loaded at run time only). `max_loras` device slots (adapters of
    # one batch), each up to `max_lora_rank`.
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if len({name for name, _ in self.lora_modules}) != len(self.lora_modules):
            raise ValueError("lora_modules: each adapter name may appear once")
        if self.task not in get_args(EngineTask):
            raise ValueError(f"unknown task {self.task!r}: use one of {', '.join(get_args(EngineTask))}")
        if self.dtype not in get_args(DType):
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(get_args(DType))}")
        if self.weights not in get_args(Weights):
            raise ValueError(f"unknown weights {self.weights!r}: use one of {', '.join(get_args(Weights))}")
        if self.kv_cache_dtype not in get_args(KVCacheDType):
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}: use one of {', '.join(get_args(KVCacheDType))}"
            )
        if self.quantization not in get_args(Quantization):
            raise ValueError(
                f"unknown quantization {self.quantization!r}: use one of {', '.join(get_args(Quantization))}"
            )
        if self.decode_entries_per_request < 1:
            raise ValueError(f"decode_entries_per_request must be >= 1, got {self.decode_entries_per_request}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} of {self.tp_size}")

    @property
    def lora(self) -> bool:
        """Whether the engine serves LoRA adapters."""
        return self.enable_lora or bool(self.lora_modules)

    @property
    def gguf_model(self) -> bool:
        """A GGUF file (or the embedded default, which is one)."""
        return self.model is None or self.model.endswith(".gguf")
