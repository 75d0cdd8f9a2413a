"""The memory floor of the offline workload's decode: the bytes every decode step must read (each
running request's KV cache, within each layer's sliding window; the dense weights once per step;
for a MoE model, the experts the step's tokens are routed to) over the device's measured bandwidth.
Prefill (compute-bound) and the host are left out, so a real run is always slower; the floor says
how far.

`python -m minisgl.bench offline` prints this floor beside every run (the `floor_*` and
`fraction_of_floor` fields of its JSON line); `python -m minisgl.bench.roofline [offline bench
args] [--bandwidth TB/s] [--measured TOK/S]` prints it alone, without running the model. Both read
the model's shape from its config (the weights on the meta device: nothing is allocated). Without
`--bandwidth` the bandwidth is measured: a device-to-device copy of 2 GiB on a GPU, 256 MiB on a
CPU (read + write bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, NamedTuple

import torch
from torch import nn

from minisgl.bench.workload import add_workload_args, make_workload
from minisgl.models.config import ModelConfig
from minisgl.platform import init_platform
from minisgl.platform.base import BasePlatform

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def kv_bytes_per_step(config: ModelConfig, seq_len: int, dtype_bytes: int) -> int:
    """K and V bytes one decode step reads for one request of `seq_len` cached tokens (MLA: the
    one latent vector per token and layer, kv_lora_rank + qk_rope_head_dim values)."""
    if config.deepseek is not None:
        per_token = (config.deepseek.kv_lora_rank + config.deepseek.qk_rope_head_dim) * dtype_bytes
    else:
        per_token = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    total = 0
    for layer in range(config.num_layers):
        window = config.layer_window(layer)
        total += per_token * (seq_len if window is None else min(seq_len, window))
    return total


class WeightBytes(NamedTuple):
    """A decode step's parameter bytes: `dense`, read whatever the batch, and the experts of the
    MoE layers, `per_expert` bytes for each (layer, expert) a token is routed to."""

    dense: int
    per_expert: int  # summed over the MoE layers: the bytes of one expert in every layer
    num_experts: int
    top_k: int

    @property
    def total(self) -> int:
        """Every parameter byte, as if a step touched every expert."""
        return self.dense + self.per_expert * self.num_experts

    def per_step(self, batch: int) -> float:
        """Bytes one decode step of `batch` tokens reads: with routing spread evenly, a token misses
        a given expert with probability 1 - k/E, so a step touches E * (1 - (1 - k/E)^batch)
        distinct experts per layer in expectation."""
        if not self.num_experts:
            return float(self.dense)
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        return self.dense + self.per_expert * touched


def weight_bytes(config: ModelConfig, dtype_bytes: int, model: nn.Module | None = None) -> WeightBytes:
    """Parameter bytes of a decode step: every weight once, except an untied input embedding (only
    the batch's rows are gathered; a tied one is read whole as the LM head), and the experts of a
    MoE layer (parameters stacked [num_experts, ...]) counted per routed expert.

    Without `model`, the config's model is built on the meta device and every parameter counted at
    `dtype_bytes`; with a loaded model, each parameter at its own storage size (GPT-OSS's MXFP4
    experts held 4-bit on a GPU: their uint8 codes and scales)."""
    from minisgl.models.registry import build_model

    stored = model is not None
    if model is None:
        with torch.device("meta"):
            model = build_model(config)
    experts = getattr(config, "num_experts", 0) or 0
    dense = per_expert = 0
    for name, param in model.named_parameters():  # a tied weight is listed once
        if "embed_tokens" in name and not config.tie_word_embeddings:
            continue
        size = param.element_size() if stored else dtype_bytes
        if experts and ".experts." in name and param.shape[0] == experts:
            per_expert += param[0].numel() * size
        else:
            dense += param.numel() * size
    if stored:  # weights a layer's function holds instead of its parameter (GGUF blocks, FP8)
        dense += sum(getattr(getattr(m, "_linear", None), "nbytes", 0) for m in model.modules())
    return WeightBytes(dense, per_expert, experts, getattr(config, "num_experts_per_tok", 0) or 0)


def weight_bytes_per_step(config: ModelConfig, dtype_bytes: int) -> int:
    """Every parameter byte a decode step would read if it touched every expert."""
    return weight_bytes(config, dtype_bytes).total


def measure_bandwidth(platform: BasePlatform, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy (read + write), timed between synchronizations:
    2 GiB on a GPU, 256 MiB (well past the caches) on a CPU."""
    size = (2 << 30) if platform.name == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=platform.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    platform.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    platform.synchronize()
    return 2 * src.numel() * iters / (time.perf_counter() - start)


def bandwidth_of(args: argparse.Namespace) -> float:
    """--bandwidth (TB/s) in bytes/s, else a copy timed on --device (its buffers handed back, so an
    engine built after sizes its KV pool as without it)."""
    if args.bandwidth:
        return float(args.bandwidth * 1e12)
    platform = init_platform(args.device)
    bandwidth = measure_bandwidth(platform)
    platform.empty_cache()
    return bandwidth


def _dtype_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """(weight bytes, KV bytes) per value from the flags: `auto` counts as bf16 (a GPU's default);
    fp8 KV pages hold one byte, an explicit 16/32-bit page type its own size, `auto` pages the
    weights' (`bench offline` reads the engine's actual pool instead)."""
    weights = _DTYPE_BYTES[args.dtype]
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    kv = 1 if kv_dtype.startswith("fp8") else _DTYPE_BYTES.get(kv_dtype, weights)
    return weights, kv


def floor(args: argparse.Namespace, bandwidth: float, measured_tok_s: float | None = None,
          dtype_bytes: tuple[int, int] | None = None, model: nn.Module | None = None,
          config: ModelConfig | None = None) -> dict[str, Any]:  # fmt: skip
    """The floor of the workload `args` describe; `dtype_bytes` (weight, KV bytes per value: what
    an engine actually runs) overrides the flags' reading, and a loaded `model` has its weights
    counted as stored (see `weight_bytes`), with its `config` (the embedded model has no --model)."""
    config = config or ModelConfig.from_dir(args.model)
    w_bytes, kv_dtype_bytes = dtype_bytes or _dtype_bytes(args)
    prompts, outputs = make_workload(args)
    # A request of prompt p and n output tokens: its first token comes from prefill, then n - 1
    # decode steps read p + 1, ..., p + n - 1 cached tokens.
    kv = sum(
        kv_bytes_per_step(config, len(p) + t, kv_dtype_bytes) for p, n in zip(prompts, outputs) for t in range(1, n)
    )
    # Every request decodes at once (the workload fits on a GPU): step t holds the requests with
    # more than t output tokens.
    steps = max(outputs, default=1) - 1
    batches = [sum(1 for n in outputs if n > t) for t in range(1, steps + 1)]
    wb = weight_bytes(config, w_bytes, model)
    weights = sum(wb.per_step(b) for b in batches)
    seconds = (kv + weights) / bandwidth
    tokens = sum(outputs)
    record = {
        "model": args.model, "output_tokens": tokens, "decode_steps": steps, "kv_bytes": kv,
        "weight_bytes_per_step": wb.total, "weight_bytes": round(weights),
        "bandwidth_tb_s": round(bandwidth / 1e12, 3), "floor_s": round(seconds, 3),
        "floor_tok_s": round(tokens / seconds, 1),
    }  # fmt: skip
    if measured_tok_s is not None:
        record["measured_tok_s"] = measured_tok_s
        record["fraction_of_floor"] = round(measured_tok_s / record["floor_tok_s"], 4)
    return record


def main(argv: list[str] | None = None) -> int:
    from minisgl.server.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="python -m minisgl.bench.roofline", description=__doc__)
    add_engine_args(parser, offline=True)
    add_workload_args(parser)
    parser.add_argument("--bandwidth", type=float, default=None, help="TB/s (default: measured on the device)")
    parser.add_argument("--measured", type=float, default=None, help="a run's output tok/s, to print its share")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    record = floor(args, bandwidth_of(args), args.measured)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
