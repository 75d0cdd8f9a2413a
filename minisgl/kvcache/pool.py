from __future__ import annotations

import mmap

import torch

# `--kv-cache-dtype` names -> the pages' torch dtype ("auto": `resolve_kv_dtype` decides).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def resolve_kv_dtype(choice: str, model_dtype: torch.dtype, gguf_blocks: bool, attn: str, latent: bool,
                     half: torch.dtype = torch.float16) -> torch.dtype:  # fmt: skip
    """The pages' dtype for `--kv-cache-dtype choice`. "auto": the model dtype, except for GGUF
    weights kept quantized (`gguf_blocks`: fp32 activations on CPU) under the torch backend, where
    pages are `half` (half the bytes; each element rounded to nearest even on store, read back into
    fp32 math: llama.cpp's f16 cache). `half` is fp16 where the CPU converts fp16 in hardware (F16C
    with AVX2, AVX-512) and bf16 on the portable path, whose fp16 conversion is scalar (~3x the time
    of fp32 pages; bf16's is a shift). A float dtype other than the model's needs the torch backend
    (it reads pages into q's dtype; the Triton kernels take the model's dtype or float8) and a
    K/V pool (an MLA latent cache stays in the model dtype); else a ValueError naming the flag."""
    if choice == "auto":
        return half if gguf_blocks and attn == "torch" and not latent else model_dtype
    dtype = KV_CACHE_DTYPES[choice]
    if dtype not in (model_dtype, torch.float8_e4m3fn):
        if latent:
            raise ValueError(f"an MLA model's latent cache is in the model dtype: drop --kv-cache-dtype {choice}")
        if attn != "torch":
            model = str(model_dtype).removeprefix("torch.")
            raise ValueError(f"--kv-cache-dtype {choice} under a {model} model needs --attn torch (the {attn} "
                             f"kernels read pages of the model dtype or fp8_e4m3)")  # fmt: skip
    return dtype


def zeroed_buffers(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """`count` zero tensors of `shape`. In host memory they are views of one anonymous mapping,
    whose pages the kernel supplies (zeroed) on first write: a page of the pool costs memory only
    once a request writes it, so an idle or lightly used server does not hold the whole pool
    (torch.zeros would write, and so commit, every byte at start-up)."""
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    per_buffer = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if count * per_buffer == 0:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    # Private (Python's default for an anonymous map is shared memory, which forked children
    # would share); the tensor keeps the mapping alive (frombuffer holds a reference to it).
    mapping = mmap.mmap(-1, count * per_buffer, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    return list(flat.view(dtype).view(count, *shape).unbind(0))


class KVPool:
    """K and V buffers for every layer: `k[layer][slot]` is [Hkv, D]; slot = page * page_size + offset.

    One extra page past `num_pages` is a scratch page: padded (CUDA-graph) batch entries write there,
    so they never touch a live request's KV.

    A pool may be narrower than the model (`compute_dtype`): fp16 or bf16 pages under fp32
    activations store each element rounded to nearest even, and attention reads them into fp32.

    A float8 pool (`dtype` float8_e4m3fn) stores `k / k_scale[layer]` (and v likewise), saturated
    at +-448; readers multiply back. The scales are per layer, 1.0 unless the checkpoint has them
    (`set_scales`). Attention folds them in rather than dequantizing the pages: scores scale by
    `k_scale` (into the softmax scale), the output by `v_scale`.
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
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the pages' element type; `compute_dtype`: the model's (q's), default `dtype`."""
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.quantized = dtype == torch.float8_e4m3fn
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        # While set (engine/kv_scales.py calibrating): each layer's largest |k| and |v| stored.
        self.observed: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        num_slots = (num_pages + 1) * page_size
        buffers = zeroed_buffers(2 * num_layers, (num_slots, num_kv_heads, head_dim), dtype, device)
        self.k, self.v = buffers[:num_layers], buffers[num_layers:]

    @property
    def scratch_slot(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def set_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Per-layer (k_scale, v_scale) of a quantized pool, e.g. from the checkpoint."""
        for layer, (k_scale, v_scale) in scales.items():
            if not (k_scale > 0 and v_scale > 0):
                raise ValueError(f"layer {layer}: KV cache scales must be positive, got {k_scale}, {v_scale}")
            self.k_scale[layer], self.v_scale[layer] = float(k_scale), float(v_scale)

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x in the pool's element type (float8: divided by `scale`, saturated)."""
        if not self.quantized:
            return x.to(self.dtype)
        if scale != 1.0:  # times the reciprocal, as the store kernel does (kernels/store_kv.py)
            x = x.float() * (1.0 / scale)
        return x.clamp(-FP8_MAX, FP8_MAX).to(self.dtype)

    def store(self, layer_id: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_copy_, not `pool[out_loc] = k`: on CPU the advanced-indexing store into a large
        # pool costs ~190 us for 32 rows, index_copy_ ~4 us (60 stores per step for SmolLM2).
        # float8 has no index_copy_ kernel: the bytes are copied through uint8 views.
        if self.observed is not None:
            k_max, v_max = k.abs().amax().float(), v.abs().amax().float()
            if layer_id in self.observed:
                seen = self.observed[layer_id]
                k_max, v_max = torch.maximum(k_max, seen[0]), torch.maximum(v_max, seen[1])
            self.observed[layer_id] = (k_max, v_max)
        k_cache, v_cache = self.k[layer_id], self.v[layer_id]
        k, v = self.quantize(k, self.k_scale[layer_id]), self.quantize(v, self.v_scale[layer_id])
        if self.quantized:
            k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
        k_cache.index_copy_(0, out_loc, k)
        v_cache.index_copy_(0, out_loc, v)
