"""Per-layer scales of a float8 KV cache, measured at engine start when the checkpoint has none.

A checkpoint quantized for FP8 KV carries `k_scale` / `v_scale` per layer (models/loader.py);
most do not. With every scale at 1.0 (vLLM's default) small activations fall into float8's
subnormal range, where it keeps less than its 3 mantissa bits: 44 % of the embedded SmolLM2's
first-layer V values are below 2^-6, and its perplexity on tests/data/kjv_genesis.txt rose 2.5 %
over the fp32 cache (tests/golden/test_fp8_kv.py). So the engine runs one calibration prefill
over fixed pseudo-random token ids before serving, through the torch attention backend (every
k/v then passes `KVPool.store`, whatever fused path the real backend takes), and sets each
layer's scale to `HEADROOM x amax / 448`: the largest value seen maps to 448 / HEADROOM, room for
larger activations on real text (its amax ran 1.2-1.6x the calibration's here), while values
down to amax x 1e-4 stay in the normal range. Same ids every start: the same scales, so runs
are reproducible and no request's content decides another's numerics.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.batch import ForwardBatch
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Req, SamplingParams
from minisgl.engine.graph import EagerRunner
from minisgl.kvcache.pool import FP8_MAX, KVPool
from minisgl.layers.attention import AttentionLayer

CALIBRATION_TOKENS = 512
HEADROOM = 4.0
SEED = 0


def calibration_request(vocab_size: int, num_tokens: int, page_size: int) -> tuple[Req, list[int]]:
    """The calibration prefill: `num_tokens` fixed token ids on token-table row 0 and the first
    pages (both free at start-up; what it writes is overwritten before a request reads it), and
    the KV slots of its tokens."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()
    req = Req(-1, ids, SamplingParams(temperature=0))
    req.row, req.extend_len = 0, num_tokens
    req.pages = list(range(-(-num_tokens // page_size)))
    return req, [req.pages[p // page_size] * page_size + p % page_size for p in range(num_tokens)]


@torch.inference_mode()
def measure_kv_scales(
    model: nn.Module, pool: KVPool, batch: ForwardBatch, num_heads: int, head_dim: int, sm_scale: float,
    backend: BaseAttnBackend,
) -> dict[int, tuple[float, float]]:  # fmt: skip
    """{layer: (k_scale, v_scale)} from running `batch` (the calibration request's) through the
    torch backend; the layers are bound back to `backend` afterwards."""
    calibrate = TorchAttnBackend(pool, num_heads, pool.num_kv_heads, head_dim, sm_scale)
    layers = [m for m in model.modules() if isinstance(m, AttentionLayer)]
    for layer in layers:
        layer.bind(calibrate)
    pool.observed = {}
    try:
        EagerRunner(model, calibrate).run(batch)
        observed = {layer: (float(k), float(v)) for layer, (k, v) in pool.observed.items()}
    finally:
        pool.observed = None
        for layer in layers:
            layer.bind(backend)
    tiny = torch.finfo(torch.float32).tiny
    return {
        layer: (max(k, tiny) * HEADROOM / FP8_MAX, max(v, tiny) * HEADROOM / FP8_MAX)
        for layer, (k, v) in observed.items()
    }


def calibrate(engine: Any, build_batch: Callable[[Req, list[int]], ForwardBatch]) -> str:
    """Measure and set the engine's float8 pool scales (engine.Engine._set_kv_scales; `build_batch`
    makes the engine's batch of one request and its slots). Returns what the log says."""
    pool, mc = engine.pool, engine.model_config
    n = min(CALIBRATION_TOKENS, engine.context_len, pool.num_pages * pool.page_size)
    req, slots = calibration_request(mc.vocab_size, n, pool.page_size)
    batch = build_batch(req, slots)
    num_heads = engine.attn_shape[0]
    pool.set_scales(measure_kv_scales(engine.model, pool, batch, num_heads, mc.head_dim, mc.softmax_scale,
                                      engine.attn_backend))  # fmt: skip
    engine.token_table[0].zero_()
    return f"scales measured on a {n}-token calibration prefill"
