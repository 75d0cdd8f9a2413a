"""The memory floor of the offline workload's decode: the bytes every decode step must read (each
running request's KV cache, within each layer's sliding window, and the weights once per step)
over the device's measured bandwidth. Prefill (compute-bound) and the host are left out, so a
real run is always slower; the floor says how far.

`python -m minisgl.bench.roofline [offline bench args] [--bandwidth TB/s] [--measured TOK/S]`
builds the same workload as `bench offline` from the same arguments, reads the model's shape from
its config (the weights on the meta device: nothing is allocated), and prints one JSON line.
Without `--bandwidth` it times a device-to-device copy of 2 GiB on the GPU (read + write bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from minisgl.bench.offline import build_parser, make_workload
from minisgl.models.config import ModelConfig
from minisgl.platform import init_platform
from minisgl.platform.base import BasePlatform

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def kv_bytes_per_step(config: ModelConfig, seq_len: int, dtype_bytes: int) -> int:
    """K and V bytes one decode step reads for one request of `seq_len` cached tokens."""
    per_token = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    total = 0
    for layer in range(config.num_layers):
        window = config.layer_window(layer)
        total += per_token * (seq_len if window is None else min(seq_len, window))
    return total


def weight_bytes_per_step(config: ModelConfig, dtype_bytes: int) -> int:
    """Parameter bytes a decode step reads: every weight once, except an untied input embedding
    (only the batch's rows are gathered); a tied one is read whole as the LM head."""
    from minisgl.models.registry import build_model

    with torch.device("meta"):
        model = build_model(config)
    total = 0
    for name, param in model.named_parameters():  # a tied weight is listed once
        if "embed_tokens" in name and not config.tie_word_embeddings:
            continue
        total += param.numel() * dtype_bytes
    return total


def measure_bandwidth(platform: BasePlatform, gib: int = 2, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy (read + write), timed between synchronizations."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=platform.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    platform.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    platform.synchronize()
    return 2 * src.numel() * iters / (time.perf_counter() - start)


def floor(args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    config = ModelConfig.from_dir(args.model)
    dtype_bytes = _DTYPE_BYTES[args.dtype]
    prompts, outputs = make_workload(args)
    # A request of prompt p and n output tokens: its first token comes from prefill, then n - 1
    # decode steps read p + 1, ..., p + n - 1 cached tokens.
    kv = sum(
        kv_bytes_per_step(config, len(p) + t, dtype_bytes) for p, n in zip(prompts, outputs) for t in range(1, n)
    )
    steps = max(outputs, default=1) - 1  # every request decodes at once (the workload fits on a GPU)
    weights = weight_bytes_per_step(config, dtype_bytes)
    seconds = (kv + steps * weights) / bandwidth
    tokens = sum(outputs)
    return {
        "model": args.model, "output_tokens": tokens, "decode_steps": steps, "kv_bytes": kv,
        "weight_bytes_per_step": weights, "bandwidth_tb_s": round(bandwidth / 1e12, 3),
        "floor_s": round(seconds, 3), "floor_tok_s": round(tokens / seconds, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.description = __doc__
    parser.add_argument("--bandwidth", type=float, default=None, help="TB/s (default: measured on the GPU)")
    parser.add_argument("--measured", type=float, default=None, help="a run's output tok/s, to print its share")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.bandwidth is not None:
        bandwidth = args.bandwidth * 1e12
    else:
        platform = init_platform("auto")
        if platform.name != "cuda":
            parser.error("no GPU to measure: pass --bandwidth TB/s")
        bandwidth = measure_bandwidth(platform)
    record = floor(args, bandwidth)
    if args.measured is not None:
        record["measured_tok_s"] = args.measured
        record["fraction_of_floor"] = round(args.measured / record["floor_tok_s"], 4)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
