"""FP8 KV cache on the GPU (skipped without CUDA; the CPU tests are tests/unit/test_fp8_kv.py):
the store kernel's float8 bytes equal torch's conversion bit for bit (the interpreter cannot check
rounding), the Triton extend and decode kernels over float8 pages with per-layer scales equal the
references over the dequantized pages, and an engine with `--kv-cache-dtype fp8_e4m3` on the
Triton backend (CUDA graphs on) decodes the same greedy tokens as the torch backend over the same
float8 pages (fp32 activations: both attend exactly)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from minisgl.kernels.attention.decode import FP8_ROUTES
from tests.kernels.test_attention_kernels import assert_close, build_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FP8 = torch.float8_e4m3fn


def test_store_kv_fp8_gpu() -> None:
    from minisgl.kernels.store_kv import store_kv, store_kv_ref

    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(300, 2, 8, 128, generator=gen) * 40).cuda().bfloat16()
    loc = torch.randperm(1000, generator=gen)[:300].cuda()
    caches = [torch.zeros(1000, 8, 128, dtype=FP8, device="cuda") for _ in range(4)]
    store_kv(kv[:, 0], kv[:, 1], caches[0], caches[1], loc, 0.021, 0.37)
    store_kv_ref(kv[:, 0], kv[:, 1], caches[2], caches[3], loc, 0.021, 0.37)
    for got, want in zip(caches[:2], caches[2:]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)])
def test_attention_kernels_over_fp8_pages(window: int | None, heads: tuple[int, int]) -> None:
    from minisgl.kernels.attention import decode_attention, extend_attention
    from minisgl.kernels.attention_ref import decode_attention_ref, extend_attention_ref

    case = build_case([0, 700, 37], [300, 129, 64], *heads, 128, 16, torch.bfloat16, seed=3)
    k_scale, v_scale = 0.013, 0.0071
    # Saturated as the store does (CUDA's conversion gives NaN past 448); the NaN poison stays NaN.
    k8 = (case.k_cache.float() / k_scale).clamp(-448, 448).to(FP8)
    v8 = (case.v_cache.float() / v_scale).clamp(-448, 448).to(FP8)
    k_deq, v_deq = (k8.float() * k_scale).bfloat16(), (v8.float() * v_scale).bfloat16()
    args = (case.token_table, case.rows, case.seq_lens, case.extend_lens, case.extend_starts, 128**-0.5)
    out = extend_attention(case.q, k8, v8, *args, max_extend_len=300, window=window, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, extend_attention_ref(case.q, k_deq, v_deq, *args, window=window), torch.bfloat16)
    q1 = case.q[:3].contiguous()
    dargs = (case.token_table, case.rows, case.seq_lens, 128**-0.5)
    for splits, route in itertools.product((1, 4), (None, *FP8_ROUTES)):  # None: the default route
        got = decode_attention(q1, k8, v8, *dargs, num_splits=splits, window=window, k_scale=k_scale, v_scale=v_scale,
                               fp8_route=route)  # fmt: skip
        assert_close(got, decode_attention_ref(q1, k_deq, v_deq, *dargs, window=window), torch.bfloat16)


@pytest.mark.parametrize("row_norm", [False, True])
def test_rotary_store_into_fp8_gpu(row_norm: bool) -> None:
    """The fused rotary + KV store into float8 pages writes, bit for bit, what `store_kv` writes
    from the same kernel's bf16 output (the pair it replaces on a float8 pool)."""
    from minisgl.kernels.rotary import rotary_store_kv
    from minisgl.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(2)
    tokens, slots = 300, 1000
    q, k, v = ((torch.randn(tokens, h, 128, generator=gen) * 30).cuda().bfloat16() for h in (16, 8, 8))
    cos, sin = (torch.randn(4096, 64, generator=gen).cuda() for _ in range(2))
    positions = torch.randint(0, 4096, (tokens,), generator=gen).cuda()
    loc = torch.randperm(slots, generator=gen)[:tokens].cuda()
    norms = ((1 + 0.1 * torch.randn(128, generator=gen)).cuda().bfloat16(),) * 2 + (1e-6, 1e-6)
    rows = ((3 * torch.randn(tokens, 1024, generator=gen)).cuda().bfloat16(), 1e-6) if row_norm else None
    scales = (0.021, 0.37)
    k16, v16 = (torch.zeros(slots, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q_want = rotary_store_kv(positions, q, k, v, cos, sin, k16, v16, loc, norms, rows)
    want = [torch.zeros(slots, 8, 128, dtype=FP8, device="cuda") for _ in range(2)]
    store_kv(k16[loc], v16[loc], want[0], want[1], loc, *scales)
    got = [torch.zeros(slots, 8, 128, dtype=FP8, device="cuda") for _ in range(2)]
    assert torch.equal(rotary_store_kv(positions, q, k, v, cos, sin, got[0], got[1], loc, norms, rows, scales), q_want)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_engine_fp8_kv_triton_equals_torch_backend(tmp_path: Path) -> None:
    from minisgl import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    make_tiny_model("qwen3", tmp_path)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 130)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for attn in ("torch", "triton"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", attn=attn, kv_cache_dtype="fp8_e4m3", num_pages=128)
        assert llm.engine.pool.dtype == FP8
        outs[attn] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs["triton"] == outs["torch"]
