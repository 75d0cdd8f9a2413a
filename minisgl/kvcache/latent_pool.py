"""The paged latent cache of multi-head latent attention (DeepSeek-V2/V3).

Per token and layer MLA caches one vector: the normalised KV latent (`kv_lora_rank` values) and
the rotated shared rope key (`qk_rope_head_dim`), not per-head K and V. Keys and values are both
derived from that one vector (absorbed decode reads it as the key and its latent part as the
value), so the pool holds a single buffer per layer.
"""

from __future__ import annotations

import torch

from minisgl.kvcache.pool import KVPool, zeroed_buffers


class LatentPool(KVPool):
    """`latent[layer][slot]` is [kv_lora_rank + rope_dim]; slots, pages and the scratch page as in
    `KVPool`, so the scheduler, radix cache and allocator see the same interface.

    `k[layer]` is the same buffer viewed as one KV head [slots, 1, latent_dim] and `v` aliases it:
    an attention backend built on this pool reads a valid layout, while no second buffer exists.
    Float8 latents are not supported."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # KVPool's fields without its two buffers: `dtype` doubles as the compute dtype.
        if dtype == torch.float8_e4m3fn:
            raise ValueError("an MLA model's latent cache cannot be float8 (drop --kv-cache-dtype)")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + rope_dim
        self.dtype = self.compute_dtype = dtype
        self.quantized = False
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.observed = None
        num_slots = (num_pages + 1) * page_size
        self.latent = zeroed_buffers(num_layers, (num_slots, self.head_dim), dtype, device)
        self.k = [buf.view(num_slots, 1, self.head_dim) for buf in self.latent]
        self.v = self.k

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
        """(kv_lora_rank + rope_dim) x layers x element size."""
        return (kv_lora_rank + rope_dim) * num_layers * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def latent_bytes_per_page(num_layers: int, page_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
        return page_size * LatentPool.bytes_per_token(num_layers, kv_lora_rank, rope_dim, dtype)

    def store_latent(self, layer_id: int, out_loc: torch.Tensor, latent: torch.Tensor) -> None:
        """Write [T, latent_dim] (normalised latent, then the rotated rope key) at slots `out_loc`."""
        self.latent[layer_id].index_copy_(0, out_loc, latent.to(self.dtype))

    def store(self, layer_id: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # A generic backend's store: k is the latent as one head; v aliases it.
        self.store_latent(layer_id, out_loc, k.reshape(k.shape[0], self.head_dim))
