"""The Triton kernels address the KV pool only through its strides: on a head-major pool
([Hkv, slots, D] seen as [slots, Hkv, D] through a permuted view) they give the token-major
results bit for bit. (The engine keeps the token-major pool: on the H200 the head-major one read
no faster, `tools/sweep_decode_attention.py --layout`.) Interpreter on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels.attention import decode_attention, extend_attention  # noqa: E402
from minisgl.kernels.rotary import rotary_store_kv  # noqa: E402
from minisgl.kernels.store_kv import store_kv  # noqa: E402
from tests.kernels.test_attention_kernels import DEVICE, build_case  # noqa: E402


def head_major(cache: torch.Tensor) -> torch.Tensor:
    slots, heads, dim = cache.shape
    out = torch.empty(heads, slots, dim, dtype=cache.dtype, device=cache.device).permute(1, 0, 2)
    return out.copy_(cache)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_same_on_head_major(num_splits: int) -> None:
    case = build_case([0, 17, 33], [1, 1, 1], 8, 2, 64, 16, torch.float32)
    args = (case.token_table, case.rows, case.seq_lens, 0.125)
    q = case.q.contiguous()
    plain = decode_attention(q, case.k_cache, case.v_cache, *args, num_splits=num_splits)
    permuted = decode_attention(q, head_major(case.k_cache), head_major(case.v_cache), *args, num_splits=num_splits)
    assert torch.equal(plain, permuted)


def test_extend_same_on_head_major() -> None:
    case = build_case([3, 0, 50], [7, 33, 2], 4, 2, 64, 16, torch.float32)
    args = (case.token_table, case.rows, case.seq_lens, case.extend_lens, case.extend_starts, 0.125)
    plain = extend_attention(case.q, case.k_cache, case.v_cache, *args, max_extend_len=33)
    permuted = extend_attention(case.q, head_major(case.k_cache), head_major(case.v_cache), *args, max_extend_len=33)
    assert torch.equal(plain, permuted)


def test_stores_same_on_head_major() -> None:
    gen = torch.Generator().manual_seed(3)
    heads, dim, slots = 2, 64, 40
    kv = torch.randn(7, 2, heads, dim, generator=gen).to(DEVICE)
    loc = torch.randperm(slots, generator=gen)[:7].to(DEVICE)
    token = [torch.zeros(slots, heads, dim, device=DEVICE) for _ in range(2)]
    head = [head_major(c) for c in token]
    store_kv(kv[:, 0], kv[:, 1], *token, loc)
    store_kv(kv[:, 0], kv[:, 1], *head, loc)
    assert torch.equal(token[0], head[0]) and torch.equal(token[1], head[1])
    # The rotary kernel's own store (the Triton backend's path).
    q = torch.randn(7, 4, dim, generator=gen).to(DEVICE)
    positions = torch.arange(7, device=DEVICE)
    half = dim // 2
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(half) / half)).to(DEVICE)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    outs = []
    for k_cache, v_cache in (token, head):
        outs.append(rotary_store_kv(positions, q, kv[:, 0], kv[:, 1], cos, sin, k_cache, v_cache, loc))
    assert torch.equal(outs[0], outs[1]) and torch.equal(token[0], head[0]) and torch.equal(token[1], head[1])
