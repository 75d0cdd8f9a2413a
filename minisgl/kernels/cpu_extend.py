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
attention backend uses it where it uses the decode kernel (`cpu_attention.pool_dtypes()`), calling
the library handle it holds (`CpuKernels.extend_attention`).
"""

from __future__ import annotations


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size (a multiple of 16)."""
    return head_dim % 16 == 0
