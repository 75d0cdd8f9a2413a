"""The engine and scheduler flags, one definition shared by `python -m minisgl` and
`python -m minisgl.bench offline`: `add_engine_args(parser)` adds them in groups,
`engine_config(args)` and `scheduler_config(args)` read them back into the configs.

Every behaviour switch of the configs is a flag here (`--x/--no-x`; tri-state where the default
is the platform's choice), so `--help` lists them all and two nodes of a launch compare them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from typing import Any, Callable, NamedTuple, get_args

from minisgl.engine.config import DType, EngineConfig, EngineTask, KVCacheDType, Quantization, Weights
from minisgl.platform.kernel_config import CpuIsa, KernelConfig
from minisgl.scheduler.config import SchedulerConfig, SpeculativeAlgorithm

SERVER_PREFILL_TOKENS = 8192  # the server's --max-prefill-tokens default on a GPU (latency)
# ... and on CPU: W2 through the server at the same throughput as 8192, TTFT p50 -20 %, and
# offline 1.1x (docs/performance.md "Prefill chunk size on CPU").
CPU_SERVER_PREFILL_TOKENS = 2048


def server_prefill_tokens(device: str) -> int:
    """The server's --max-prefill-tokens default for `device` ("auto": CUDA if there is one)."""
    from minisgl.platform import device_name

    return CPU_SERVER_PREFILL_TOKENS if device_name(device) == "cpu" else SERVER_PREFILL_TOKENS


def _number(kind: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse `type=` that parses `kind` and accepts values with `ok`, else says what it expected."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
port = _number(int, lambda v: 0 <= v <= 65535, "a port number 0-65535")
positive_float = _number(float, lambda v: v > 0, "a positive number")
non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a number >= 0")


def device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N")


# One flag per KernelConfig field: --fused-kernels for fused_kernels, and so on.
KERNEL_SWITCHES: dict[str, str] = {
    "fused_kernels": "fused Triton norm/rotary/SiLU/sampling kernels on CUDA (off: the torch references)",
    "pdl": "programmatic dependent launch of the Triton kernels (sm90+ GPUs)",
    "fold_norms": "fold the RMSNorm weights into the qkv and gate_up projections (triton attention backend)",
    "triton_gemm": "the split-K Triton GEMM for o_proj/down_proj where it measured faster than cuBLAS "
    "(kernels/tuned/splitk_gemm.json)",
    "decode_tuned": "the decode attention launches measured per CUDA-graph batch size "
    "(kernels/tuned/decode_attention.json)",
    "cpu_kernels": "the bf16 C++ CPU kernels (GEMV, RMSNorm, rotary, SiLU)",
    "cpu_attn_kernel": "the C++ CPU decode attention (bf16 models; fp32 math over fp32/fp16/bf16 pages with --cpu-kernels-fp32)",
    "cpu_kernels_fp32": "the C++ CPU norms, rotary, SiLU and decode attention for fp32 activations too, "
    "not bit-exact with transformers "
    "(default: on for --weights gguf, off for a float model: the exact-parity mode)",
}
# KernelConfig's fields that are choices, not switches, each with its own flag.
KERNEL_CHOICES = ("cpu_isa",)
assert set(KERNEL_SWITCHES) | set(KERNEL_CHOICES) == {f.name for f in fields(KernelConfig)}, (
    "every KernelConfig field needs a flag")  # fmt: skip


def flag(name: str) -> str:
    """A switch field's flag: `--fold-norms` for fold_norms."""
    return "--" + name.replace("_", "-")


class EngineArgGroups(NamedTuple):
    """The groups `add_engine_args` made, for a caller's own flags of the same kind."""

    model: argparse._ArgumentGroup
    device: argparse._ArgumentGroup
    kv: argparse._ArgumentGroup
    switches: argparse._ArgumentGroup


def add_engine_args(parser: argparse.ArgumentParser, *, offline: bool = False) -> EngineArgGroups:
    """Add the engine and scheduler flags to `parser`. `offline`: --max-prefill-tokens defaults
    to the platform's offline budget (16384 on GPUs of >= 70 GiB, 2048 on CPU) instead of the
    server's (8192 on a GPU, 2048 on CPU: `server_prefill_tokens`)."""
    defaults, sched = EngineConfig(), SchedulerConfig()
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None, help="a Hugging Face model directory, a .gguf file or a hub id "
                   "(default: the embedded SmolLM2-135M-Instruct)")  # fmt: skip
    m.add_argument("--dtype", default="auto", choices=list(DType.__args__),  # type: ignore[attr-defined]
                   help="weight and activation dtype (default: auto = bfloat16 on CUDA and on CPUs with "
                   "native bf16, else float32)")  # fmt: skip
    m.add_argument("--weights", default="auto", choices=list(Weights.__args__),  # type: ignore[attr-defined]
                   help="how a GGUF model's weights are held: gguf = its quantized blocks as shipped, run by "
                   "the quantized CPU kernels (fp32 activations; CPU, one rank); float32 / bfloat16 = "
                   "dequantized (float32: the exact-vs-Hugging Face mode) (default: auto = gguf for a .gguf "
                   "model on CPU with --dtype auto, else the --dtype's)")  # fmt: skip
    m.add_argument("--quantization", default=defaults.quantization, choices=list(get_args(Quantization)),
                   help="weight quantization: auto = the checkpoint's quantization_config (FP8 checkpoints run "
                   "float8); fp8 = float8 W8A8, a float checkpoint quantized at load with per-channel weight "
                   "and per-token activation scales; fp8_block = the same with 128x128 weight blocks and per-token, "
                   "per-128-column activation scales, the layout Qwen3-*-FP8 and DeepSeek-V3 ship (default: auto)")  # fmt: skip
    m.add_argument("--dummy-weights", action="store_true", help="random weights (benchmarks without a checkpoint)")
    m.add_argument("--max-model-len", type=positive_int, default=None, help="cap on the context length")
    m.add_argument("--seed", type=int, default=defaults.seed, help="random seed of the engine (default: 0)")
    m.add_argument("--task", default=defaults.task, choices=list(EngineTask.__args__),  # type: ignore[attr-defined]
                   help="generate (text) or embed (/v1/embeddings: last-token pooling); default: auto = embed "
                   "for a checkpoint with sentence-transformers pooling or without an LM head (Qwen3Model)")  # fmt: skip
    d = parser.add_argument_group("device and parallelism")
    d.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    d.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size: one scheduler per rank")
    d.add_argument("--attn", default=None, help="attention backend (default: triton on CUDA, torch on CPU)")
    d.add_argument("--cpu-isa", default=KernelConfig().cpu_isa, choices=list(CpuIsa.__args__),  # type: ignore[attr-defined]
                   help="code path of the CPU kernels (quantized GGUF matmuls): auto = the best this CPU runs; "
                   "avx512, avx2 or portable force one (default: auto)")  # fmt: skip
    d.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=defaults.huge_pages,
                   help="start the scheduler processes with malloc's large blocks in transparent huge pages "
                   "(GLIBC_TUNABLES glibc.malloc.hugetlb=1; the system's THP mode madvise or always): a CPU "
                   "prefill's activations fault in 2 MiB at a time, not 4 KiB (default: on)")  # fmt: skip
    d.add_argument("--cuda-graph-max-bs", type=int, default=defaults.cuda_graph_max_bs,
                   help="largest batch captured in a CUDA graph; 0 off")  # fmt: skip
    k = parser.add_argument_group("KV cache and scheduling")
    k.add_argument("--page-size", type=positive_int, default=defaults.page_size,
                   help="tokens per KV page (default: 16)")  # fmt: skip
    size = k.add_mutually_exclusive_group()
    size.add_argument("--num-pages", type=positive_int, default=None,
                      help="KV pool size in pages (default: what the device can spare, at most "
                      "--max-running-requests full contexts: on CUDA 85%% of the free memory "
                      "less 2 GiB, on CPU a quarter of the free memory up to 4 GiB, whose pages the OS "
                      "supplies as requests first write them, so the server's memory grows with the KV "
                      "it holds, not with the pool's size)")  # fmt: skip
    size.add_argument("--kv-cache-gb", type=positive_float, default=None, help="KV pool size in GiB")
    k.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=list(get_args(KVCacheDType)),
                   help="KV cache element type: auto = the model dtype, except fp16 pages for GGUF weights "
                   "kept quantized on CPU (fp32 math, half the bytes); float32 / bfloat16 / float16 = pages "
                   "of that type (another than the model's: --attn torch); fp8_e4m3 = float8 pages with the "
                   "checkpoint's per-layer scales (else 1.0), twice the tokens per GiB (default: auto)")  # fmt: skip
    k.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=defaults.calculate_kv_scales,
                   help="fp8 KV cache of a checkpoint without KV scales: measure per-layer scales on a "
                   "calibration prefill at start-up; off: scales 1.0 (default: on)")  # fmt: skip
    k.add_argument("--max-running-requests", type=positive_int, default=sched.max_running_requests,
                   help="requests decoded together")  # fmt: skip
    prefill_help = ("prefill tokens per step (default: the platform's offline budget, 16384 on GPUs of >= 70 GiB, "
                    "2048 on CPU, else 8192)" if offline else
                    f"token budget of one step (default: {SERVER_PREFILL_TOKENS}; {CPU_SERVER_PREFILL_TOKENS} on CPU)")
    k.add_argument("--max-prefill-tokens", type=positive_int, default=None, help=prefill_help)
    parser.set_defaults(prefill_default="offline" if offline else "server")  # what None means: scheduler_config
    k.add_argument("--cache", default=sched.cache, choices=["radix", "naive"], help="prefix cache (default: radix)")
    _add_speculative_args(parser, sched)
    s = parser.add_argument_group("behaviour switches", "for ablations and bisecting; the defaults are the "
                                  "measured-fastest setting, and a switch a platform cannot run is off there")
    boolean = argparse.BooleanOptionalAction
    s.add_argument("--overlap-schedule", dest="overlap", action=boolean, default=None,
                   help="plan step N+1 while step N runs (default: on where the device runs asynchronously, CUDA)")
    s.add_argument("--pad-eager", action=boolean, default=None, help="pad eager (prefill) steps to a few token "
                   "counts so cuBLAS sees GEMM shapes it has seen before (default: on CUDA)")  # fmt: skip
    s.add_argument("--dedupe-prefill", action=boolean, default=sched.dedupe_prefill,
                   help="a prompt sharing pages with a request still computing them waits for the cache "
                   "(default: on)")  # fmt: skip
    add_lora_args(parser, defaults)
    kernels = KernelConfig()
    for name, text in KERNEL_SWITCHES.items():
        default = getattr(kernels, name)
        s.add_argument(flag(name), action=boolean, default=default,
                       help=text if default is None else f"{text} (default: {'on' if default else 'off'})")  # fmt: skip
    return EngineArgGroups(m, d, k, s)


def lora_module(text: str) -> tuple[str, str]:
    """`name=path` of --lora-modules."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name.strip(), path.strip()


def add_lora_args(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    g = parser.add_argument_group("LoRA adapters", "PEFT adapters served beside the base model: a request's "
                                  "`model` picks one (lora/; POST /v1/load_lora_adapter at run time)")  # fmt: skip
    g.add_argument("--lora-modules", type=lora_module, nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters loaded at start (implies --enable-lora)")  # fmt: skip
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (loaded at run time too)")
    g.add_argument("--max-loras", type=positive_int, default=defaults.max_loras,
                   help=f"adapters one batch may mix (device slots; default: {defaults.max_loras})")  # fmt: skip
    g.add_argument("--max-lora-rank", type=positive_int, default=defaults.max_lora_rank,
                   help=f"largest adapter rank served (default: {defaults.max_lora_rank})")  # fmt: skip


def _add_speculative_args(parser: argparse.ArgumentParser, sched: SchedulerConfig) -> None:
    g = parser.add_argument_group("speculative decoding", "proposed tokens verified by the model in one "
                                  "forward; greedy output is unchanged, sampling keeps its distribution")  # fmt: skip
    g.add_argument("--speculative-algorithm", default=None, choices=list(get_args(SpeculativeAlgorithm)),
                   help="ngram: continue the latest n-gram found in the request's own prompt and output "
                   "(prompt lookup); draft: a small model with the same tokenizer (default: off)")  # fmt: skip
    g.add_argument("--num-speculative-tokens", type=positive_int, default=sched.num_speculative_tokens,
                   help=f"tokens proposed per step and request (default: {sched.num_speculative_tokens})")  # fmt: skip
    g.add_argument("--speculative-draft-model", default=None,
                   help="the draft model of --speculative-algorithm draft (a model directory or hub id)")  # fmt: skip
    g.add_argument("--speculative-ngram-max", type=positive_int, default=sched.speculative_ngram_max,
                   help=f"longest n-gram looked up (default: {sched.speculative_ngram_max})")  # fmt: skip
    g.add_argument("--speculative-ngram-min", type=positive_int, default=sched.speculative_ngram_min,
                   help=f"shortest n-gram looked up (default: {sched.speculative_ngram_min})")  # fmt: skip


def check_engine_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags beyond their own types (a sentence), or None."""
    if args.cuda_graph_max_bs < 0:
        return "--cuda-graph-max-bs must be >= 0"
    if (args.speculative_algorithm == "draft") != (args.speculative_draft_model is not None):
        return "--speculative-algorithm draft and --speculative-draft-model go together"
    if args.num_speculative_tokens > 16:
        return "--num-speculative-tokens must be at most 16"
    if args.speculative_ngram_min > args.speculative_ngram_max:
        return "--speculative-ngram-min must not exceed --speculative-ngram-max"
    if args.weights == "gguf" and args.tp > 1:
        return f"--weights gguf runs at one rank: for --tp {args.tp} pass --weights float32 or bfloat16"
    if args.weights == "gguf" and args.quantization != "auto":
        return f"--weights gguf keeps the GGUF's blocks: for --quantization {args.quantization} pass --weights float32"
    if args.weights == "gguf" and args.model is not None and not args.model.endswith(".gguf"):
        return f"--weights gguf needs a .gguf model, got {args.model}: pass --weights float32 or bfloat16"
    return None


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the flags say (`overrides`: fields the caller sets itself, e.g. tp_rank)."""
    values: dict[str, Any] = dict(
        model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
        num_pages=args.num_pages, kv_cache_gb=args.kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales, dummy_weights=args.dummy_weights,
        attn=args.attn, tp_size=args.tp, cuda_graph_max_bs=args.cuda_graph_max_bs,
        max_running_requests=args.max_running_requests, max_model_len=args.max_model_len, seed=args.seed,
        pad_eager=args.pad_eager, weights=args.weights, task=args.task, quantization=args.quantization,
        lora_modules=tuple(args.lora_modules or ()), enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, huge_pages=args.huge_pages,
        kernels=KernelConfig(**{name: getattr(args, name) for name in (*KERNEL_SWITCHES, *KERNEL_CHOICES)}),
    )  # fmt: skip
    return EngineConfig(**{**values, **overrides})


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The SchedulerConfig the flags say. An unset --max-prefill-tokens is the server's default for
    the device on a server's parser, and None (the platform's offline budget) on an offline one."""
    budget = args.max_prefill_tokens
    if budget is None and getattr(args, "prefill_default", "server") == "server":
        budget = server_prefill_tokens(args.device)
    return SchedulerConfig(
        max_running_requests=args.max_running_requests, max_prefill_tokens=budget,
        cache=args.cache, overlap=args.overlap, dedupe_prefill=args.dedupe_prefill,
        speculative_algorithm=args.speculative_algorithm, num_speculative_tokens=args.num_speculative_tokens,
        speculative_draft_model=args.speculative_draft_model, speculative_ngram_max=args.speculative_ngram_max,
        speculative_ngram_min=args.speculative_ngram_min,
    )  # fmt: skip
