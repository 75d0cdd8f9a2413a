from __future__ import annotations

import torch


class KVPool:
    """K and V buffers for every layer: `k[layer][slot]` is [Hkv, D]; slot = page * page_size + offset.

    One extra page past `num_pages` is a scratch page: padded (CUDA-graph) batch entries write there,
    so they never touch a live request's KV.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        num_slots = (num_pages + 1) * page_size
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def scratch_slot(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def store(self, layer_id: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_copy_, not `pool[out_loc] = k`: on CPU the advanced-indexing store into a large
        # pool costs ~190 us for 32 rows, index_copy_ ~4 us (60 stores per step for SmolLM2).
        self.k[layer_id].index_copy_(0, out_loc, k.to(self.k[layer_id].dtype))
        self.v[layer_id].index_copy_(0, out_loc, v.to(self.v[layer_id].dtype))
