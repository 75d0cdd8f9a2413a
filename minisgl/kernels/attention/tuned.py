"""The decode launch a CUDA graph captures per batch size: the measured table
(`kernels/tuned/decode_attention.json`) where it has the device, shape and size, else the
split-count heuristic with the default launch. Tables name the KV cache they were measured on
("kv_cache": "16-bit", the default, or "fp8_e4m3"); a float8 cache without its own entry takes the
16-bit one's split count with float8's default tile and pipeline."""

from __future__ import annotations

import torch

from minisgl.kernels.attention.decode import DecodeLaunch, decode_num_splits
from minisgl.kernels.tuning import device_name, load_table

# (device name, KV heads, q heads, head_dim) -> {captured batch size: launch}
TunedKey = tuple[str, int, int, int]


def _graph_tuned(kv_cache: str) -> dict[TunedKey, dict[int, DecodeLaunch]]:
    tables: dict[TunedKey, dict[int, DecodeLaunch]] = {}
    for table in load_table("decode_attention")["tables"]:
        if table.get("kv_cache", "16-bit") != kv_cache:
            continue
        key = (table["device"], table["num_kv_heads"], table["num_heads"], table["head_dim"])
        tables[key] = {
            e["batch_size"]: DecodeLaunch(e["num_splits"], e["block_n"], e["num_warps"], e["num_stages"])
            for e in table["launches"]
        }
    return tables


GRAPH_TUNED = _graph_tuned("16-bit")
GRAPH_TUNED_FP8 = _graph_tuned("fp8_e4m3")  # measured over float8_e4m3fn pages


def decode_graph_launch(
    batch_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    *,
    tuned: bool = True,
) -> DecodeLaunch:
    """The launch a CUDA graph captures for `batch_size` requests: the measured one where
    `GRAPH_TUNED` has this GPU, shape and size and the KV cache (`kv_dtype`, the pages' element
    type) is 16-bit, as measured, or `GRAPH_TUNED_FP8` for a float8 cache (else the split count
    of `GRAPH_TUNED` with the float8 default tile; `tuned` False, --no-decode-tuned, ignores the
    tables), else the heuristic split count for a long context with the default launch."""
    if tuned and device.type == "cuda" and kv_dtype.itemsize in (1, 2):
        key = (device_name(device), num_kv_heads, num_heads, head_dim)
        fp8 = kv_dtype.itemsize == 1
        launch = (GRAPH_TUNED_FP8 if fp8 else GRAPH_TUNED).get(key, {}).get(batch_size)
        if launch is not None:
            return launch
        sixteen = GRAPH_TUNED.get(key, {}).get(batch_size)
        if fp8 and sixteen is not None:
            # The split count is parallelism (the same programs); the tile and pipeline are
            # decode_attention's float8 defaults (half the bytes a tile).
            return DecodeLaunch(sixteen.num_splits)
    return DecodeLaunch(decode_num_splits(batch_size, num_kv_heads, head_dim, None, device))
