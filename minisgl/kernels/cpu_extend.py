"""Paged extend (prefill) attention on CPU in one call per layer: a C++ kernel of the CPU kernel
library (kernels/cpp_ext.py; kernels/csrc/cpu_extend.h), on every ISA path the library has.

The torch path attends request by request: it gathers every key of the request out of the pool,
repeats K and V for each q head of a GQA group, and runs SDPA with a bool mask whenever the
request has a cached prefix or is a later chunk; at W2-like shapes (32 requests of 64-512 tokens)
that took over half of a prefill step on 2 cores. This kernel reads K and V straight from the
pool through the token table, one task per (request, KV head, block of queries) over the
library's thread pool: all the group's q heads against each block of 32 keys, causal with the
cached prefix (the query at position p sees keys 0..p), an online softmax in fp32. q is fp32 or
bf16 (the output takes its dtype); pages fp32, bf16 or fp16, converted exactly to fp32.

Plain layers only: sliding windows, logit soft-caps and attention sinks keep the torch path. The
attention backend uses it where it uses the decode kernel (`cpu_attention.pool_dtypes()`).
"""

from __future__ import annotations

import torch

from minisgl.kernels import cpu_attention
from minisgl.kernels.cpp_ext import IsaChoice


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size (a multiple of 16)."""
    return head_dim % 16 == 0


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    isa: IsaChoice | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] (each request's new tokens in turn); pools [S, Hkv, D]; table [R, C] int32
    slots; rows [B] int64; seq_lens [B] int32 (KV length after the step), extend_lens [B] int32
    -> [T, Hq, D]: request i's queries at positions seq_len - extend_len .. seq_len - 1."""
    module = cpu_attention.load()
    assert module is not None, "call cpu_attention.load() first and check it"
    return module.extend_attention(q, k_cache, v_cache, table, rows, seq_lens, extend_lens, scale, isa)
