"""Write one step's new K and V into the paged cache in a single launch.

`cache[out_loc] = new` for K and V costs two indexing kernels per layer; this does both in one,
which counts in launch-bound small-batch decode (captured once per layer in every CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from minisgl.kernels.pdl import pdl_args


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here on (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    # int64: slot * slot stride overflows int32 on large pools.
    slot = tl.load(loc_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    if FP8:  # a float8 cache holds value / scale, saturated at +-448 (kvcache/pool.py)
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:  # fmt: skip
    """k, v [T, Hkv, D] (any token/head strides) into caches [slots, Hkv, D] at slots `out_loc` [T]
    (a float8 cache: divided by the scales and saturated)."""
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape[1:] == k.shape[1:] and v_cache.shape == k_cache.shape
    assert k.stride(2) == v.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, out_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        1.0 / k_scale, 1.0 / v_scale,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=1 if num_heads * head_dim <= 1024 else 4,
        **pdl_args(k.device),
    )  # fmt: skip


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:  # fmt: skip
    if k_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() * (1.0 / k_scale)).clamp(-448.0, 448.0)
        v = (v.float() * (1.0 / v_scale)).clamp(-448.0, 448.0)
    k_cache.view(torch.uint8)[out_loc] = k.to(k_cache.dtype).view(torch.uint8)
    v_cache.view(torch.uint8)[out_loc] = v.to(v_cache.dtype).view(torch.uint8)
