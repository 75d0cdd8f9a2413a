"""The MLA latent pool: one buffer per layer of kv_lora_rank + rope values per token, the page /
slot interface of KVPool, its bytes per token logged at start-up and used to size the pool."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache.latent_pool import LatentPool
from minisgl.kvcache.pool import KVPool

LAYERS, RANK, ROPE = 3, 32, 8


def test_bytes_per_token_is_latent_plus_rope_per_layer() -> None:
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert LatentPool.bytes_per_token(LAYERS, RANK, ROPE, dtype) == (RANK + ROPE) * LAYERS * size
    # DeepSeek-V2-Lite in bf16: (512 + 64) x 27 x 2 bytes, where its K and V would take 16 x 2 x 192.
    assert LatentPool.bytes_per_token(27, 512, 64, torch.bfloat16) == 31_104
    pool = LatentPool(LAYERS, num_pages=5, page_size=4, kv_lora_rank=RANK, rope_dim=ROPE,
                      dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    allocated = sum(buf.numel() * buf.element_size() for buf in pool.latent)
    assert allocated == (5 + 1) * 4 * LatentPool.bytes_per_token(LAYERS, RANK, ROPE, torch.float32)


def test_slot_interface_and_aliased_views() -> None:
    pool = LatentPool(LAYERS, num_pages=5, page_size=4, kv_lora_rank=RANK, rope_dim=ROPE,
                      dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    assert isinstance(pool, KVPool) and (pool.num_pages, pool.page_size, pool.scratch_slot) == (5, 4, 20)
    assert (pool.num_kv_heads, pool.head_dim) == (1, RANK + ROPE) and not pool.quantized
    latent = torch.randn(3, RANK + ROPE)
    slots = torch.tensor([7, 0, 20])
    pool.store_latent(1, slots, latent)
    assert torch.equal(pool.latent[1][slots], latent) and not pool.latent[0].any()
    # k is the same memory viewed as one head; v aliases it (no second buffer).
    assert pool.k[1].data_ptr() == pool.latent[1].data_ptr() and pool.v is pool.k
    assert torch.equal(pool.k[1][slots, 0], latent)
    pool.store(2, slots, latent[:, None], latent[:, None])  # a generic backend's store
    assert torch.equal(pool.latent[2][slots], latent)


def test_float8_latents_refused() -> None:
    with pytest.raises(ValueError, match="float8"):
        LatentPool(1, 1, 4, RANK, ROPE, torch.float8_e4m3fn, torch.device("cpu"))


def _tiny_config_dir(path: Path) -> Path:
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": LAYERS, "num_attention_heads": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": RANK,
        "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": ROPE, "v_head_dim": 8,
        "max_position_embeddings": 64, "torch_dtype": "float32",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_engine_sizes_and_logs_the_latent_pool(tmp_path: Path) -> None:
    per_token = (RANK + ROPE) * LAYERS * 4
    budget_pages = 37
    gib = budget_pages * 16 * per_token / (1 << 30)
    # minisgl's loggers do not propagate to the root (caplog's): listen on the engine's own.
    logger, records = logging.getLogger("minisgl.engine.engine"), _Records()
    logger.addHandler(records)
    try:
        engine = Engine(EngineConfig(model=str(_tiny_config_dir(tmp_path)), device="cpu", dtype="float32",
                                     dummy_weights=True, page_size=16, kv_cache_gb=gib, max_running_requests=64))  # fmt: skip
    finally:
        logger.removeHandler(records)
    assert isinstance(engine.pool, LatentPool)
    assert engine.pool.num_pages == budget_pages, "the budget is divided by the latent bytes, not K + V"
    assert f"MLA latent cache: {per_token} bytes per token" in records.messages
