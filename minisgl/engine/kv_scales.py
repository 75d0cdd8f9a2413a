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

from typing import TYPE_CHECKING

import torch

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Req, SamplingParams
from minisgl.engine.graph import EagerRunner
from minisgl.kvcache.pool import FP8_MAX
from minisgl.layers.attention import AttentionLayer

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

CALIBRATION_TOKENS = 512
HEADROOM = 4.0
SEED = 0


@torch.inference_mode()
def measure_kv_scales(engine: "Engine", num_tokens: int = CALIBRATION_TOKENS) -> dict[int, tuple[float, float]]:
    """{layer: (k_scale, v_scale)} from one prefill of `num_tokens` fixed token ids on row 0 and
    the first pages (both free at start-up; whatever it writes there is overwritten before a
    request reads it). The layers are bound back to the engine's backend afterwards."""
    from minisgl.engine.engine import StepPlan

    pool, mc = engine.pool, engine.model_config
    num_tokens = min(num_tokens, engine.context_len, pool.num_pages * pool.page_size)
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, mc.vocab_size, (num_tokens,), generator=generator).tolist()
    req = Req(-1, ids, SamplingParams(temperature=0))
    req.row, req.extend_len = 0, num_tokens
    req.pages = list(range(-(-num_tokens // pool.page_size)))
    slots = [req.pages[p // pool.page_size] * pool.page_size + p % pool.page_size for p in range(num_tokens)]
    heads, kv_heads = engine.attn_shape
    backend = TorchAttnBackend(pool, heads, kv_heads, mc.head_dim, mc.softmax_scale)
    for module in engine.model.modules():
        if isinstance(module, AttentionLayer):
            module.bind(backend)
    pool.observed = {}
    try:
        batch, _ = engine.build_batch(StepPlan([req], slots))
        EagerRunner(engine.model, backend).run(batch)
        observed = {layer: (float(k), float(v)) for layer, (k, v) in pool.observed.items()}
    finally:
        pool.observed = None
        engine.token_table[0].zero_()
        for module in engine.model.modules():
            if isinstance(module, AttentionLayer):
                module.bind(engine.attn_backend)
    tiny = torch.finfo(torch.float32).tiny
    return {
        layer: (max(k, tiny) * HEADROOM / FP8_MAX, max(v, tiny) * HEADROOM / FP8_MAX)
        for layer, (k, v) in observed.items()
    }
