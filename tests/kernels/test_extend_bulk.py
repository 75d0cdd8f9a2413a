"""The extend kernel's bulk path (whole key blocks before a query block with no mask) and its key
sources (the token table, affine reads of a request whose slots are one run, TMA descriptors)
against the torch reference, and `contiguous_bases`.

Under TRITON_INTERPRET=1 without CUDA (tiny shapes, 16-wide blocks); the `gpu` test runs the
long-prefill launches in bf16. Pools are NaN outside the requests' slots and runs sit between
NaN gaps, so a read past a run, or of a slot no request owns, poisons the output.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels.attention import extend_attention, is_interpreted
from minisgl.kernels.attention.extend import contiguous_bases
from minisgl.kernels.attention_ref import extend_attention_ref
from tests.kernels.test_attention_kernels import DEVICE, TOLERANCE, assert_close

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (prefix_lens, extend_lens): prefixes on and off the 16-key grid, a one-token extend, extends
# over several query blocks, a request with no prefix.
SHAPE = ([37, 0, 16, 70], [20, 45, 1, 33])


@dataclass
class RunCase:
    args: tuple  # extend_attention's positional arguments (sm_scale last)
    max_extend_len: int


def run_case(
    prefix_lens: list[int], extend_lens: list[int], runs: list[bool], num_heads: int, num_kv_heads: int,
    head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None, seed: int = 0,
) -> RunCase:  # fmt: skip
    """Requests whose slots are one run (`runs[i]`, 5 NaN slots before and after) or scattered
    one by one over the pool; cache in `cache_dtype` (default: `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq_lens) + 5 * (len(seq_lens) + 1) + 8
    free = torch.randperm(num_slots, generator=gen).tolist()
    taken: set[int] = set()
    table = torch.full((len(seq_lens) + 1, max(seq_lens) + 16), num_slots - 1, dtype=torch.int32)
    next_run = 5
    slot_lists = []
    for seq_len, run in zip(seq_lens, runs):
        if run:
            slots = list(range(next_run, next_run + seq_len))
            next_run += seq_len + 5
        else:
            slots = []
        slot_lists.append(slots)
        taken.update(slots)
    spare = [s for s in free if s not in taken and s >= next_run]
    for i, (seq_len, run) in enumerate(zip(seq_lens, runs)):
        if not run:
            slot_lists[i] = [spare.pop() for _ in range(seq_len)]
    cache_dtype = cache_dtype or dtype
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    rows = torch.randperm(len(seq_lens) + 1, generator=gen)[: len(seq_lens)]
    for row, slots in zip(rows.tolist(), slot_lists):
        index = torch.tensor(slots, dtype=torch.int64)
        table[row, : len(slots)] = index.int()
        k_cache[index] = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
        v_cache[index] = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [sum(extend_lens[:i]) for i in range(len(seq_lens))]
    args = (
        q.to(DEVICE), k_cache.to(cache_dtype).to(DEVICE), v_cache.to(cache_dtype).to(DEVICE), table.to(DEVICE),
        rows.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE), head_dim**-0.5,
    )  # fmt: skip
    return RunCase(args, max(extend_lens))


def test_contiguous_bases() -> None:
    case = run_case([5, 0, 40], [3, 1, 9], [True, True, False], 2, 1, 16, torch.float32, seed=1)
    table, rows, seq_lens = case.args[3], case.args[4], case.args[5]
    bases = contiguous_bases(table, rows, seq_lens).tolist()
    assert bases[0] == 5 and bases[1] == 5 + 8 + 5 and bases[2] == -1
    # A run broken at its last position is not a run.
    table[rows[0], 7] = 0
    assert contiguous_bases(table, rows, seq_lens).tolist()[0] == -1


def bulk(case: RunCase, **launch: Any) -> torch.Tensor:
    return extend_attention(*case.args, max_extend_len=case.max_extend_len, block_n=16, bulk=True, **launch)


@pytest.mark.parametrize("kv_load", ["gather", "run", "tma"])
@pytest.mark.parametrize("pack", [False, True])
def test_bulk_matches_ref(kv_load: str, pack: bool) -> None:
    case = run_case(*SHAPE, [True, False, True, True], 4, 2, 16, torch.float32, seed=2)
    out = bulk(case, block_m=32 if pack else 16, pack=pack, kv_load=kv_load)
    assert_close(out, extend_attention_ref(*case.args), torch.float32)


@pytest.mark.parametrize("kv_load", ["gather", "tma"])
def test_bulk_padded_head_dim_softcap_sinks(kv_load: str) -> None:
    """D 24 pads to 32 (TMA cannot box it: the affine path instead), soft-capped, with sinks."""
    case = run_case(*SHAPE, [True, True, False, True], 3, 1, 24, torch.float32, seed=3)
    sinks = (torch.randn(3, generator=torch.Generator().manual_seed(4)) * 2.0).to(DEVICE)
    out = bulk(case, block_m=16, kv_load=kv_load, softcap=1.5, sinks=sinks)
    assert_close(out, extend_attention_ref(*case.args, softcap=1.5, sinks=sinks), torch.float32)


@pytest.mark.parametrize("kv_load", ["gather", "run", "tma"])
def test_bulk_float8_cache(kv_load: str) -> None:
    """A float8 cache with its scales: the bulk tiles are widened as the masked ones are."""
    case = run_case(*SHAPE, [True, True, True, False], 4, 2, 16, torch.float32, torch.float8_e4m3fn, seed=5)
    q, k8, v8 = case.args[:3]
    out = bulk(case, block_m=16, kv_load=kv_load, k_scale=0.5, v_scale=2.0)
    wide = (q, k8.float() * 0.5, v8.float() * 2.0, *case.args[3:])
    assert_close(out, extend_attention_ref(*wide), torch.float32)


def test_bulk_equals_masked_loop_and_rejects_windows() -> None:
    """The bulk path and the masked loop give the same output (up to summation order), and bulk
    refuses a sliding window (its unmasked blocks would show keys that slid out)."""
    case = run_case(*SHAPE, [True, True, True, True], 4, 2, 16, torch.float32, seed=6)
    masked = extend_attention(*case.args, max_extend_len=case.max_extend_len, block_m=16, block_n=16, bulk=False)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(bulk(case, block_m=16, kv_load="tma"), masked, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="window"):
        bulk(case, block_m=16, window=8)
    with pytest.raises(ValueError, match="kv_load"):
        bulk(case, block_m=16, kv_load="dense")


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_load", ["gather", "run", "tma"])
@pytest.mark.parametrize("launch", [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3), (64, 64, 4, 3)])
def test_bulk_gpu_long_launches(kv_load: str, launch: tuple[int, int, int, int]) -> None:
    """Qwen3-0.6B's heads in bf16 at the long-prefill tiles the sweep (tools/sweep_extend.py) tries."""
    case = run_case([0, 1000, 3000], [2000, 700, 129], [True, False, True], 16, 8, 128, torch.bfloat16, seed=7)
    block_m, block_n, warps, stages = launch
    out = extend_attention(*case.args, max_extend_len=case.max_extend_len, block_m=block_m, block_n=block_n,
                           num_warps=warps, num_stages=stages, pack=True, bulk=True, kv_load=kv_load)  # fmt: skip
    assert_close(out, extend_attention_ref(*case.args), torch.bfloat16)


@pytest.mark.parametrize("kv_load", ["gather", "tma"])
def test_backend_passes_bases_once(monkeypatch: pytest.MonkeyPatch, kv_load: str) -> None:
    """With a bulk launch as the default, TritonAttnBackend computes the bases once in prepare()
    ("run" / "tma" only) and every layer kind (windowed ones fall back to the masked loop) still
    equals the torch backend, mixed one-token rows included."""
    import minisgl.kernels.attention.extend as extend_mod
    from minisgl.attention.base import AttnLayerSpec
    from minisgl.attention.batch import ForwardBatch
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.attention.triton_backend import create_triton_backend
    from minisgl.kernels.attention.extend import _ExtendConfig
    from minisgl.kvcache.pool import KVPool

    config = _ExtendConfig(16, 16, 1, 1, True, True, kv_load)
    monkeypatch.setattr(extend_mod, "_extend_config", lambda *a, **k: config)
    specs = [AttnLayerSpec(), AttnLayerSpec(sliding_window=6), AttnLayerSpec(logit_cap=2.0)]
    heads, kv_heads, head_dim, page = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(9)
    pool = KVPool(len(specs), 256, page, kv_heads, head_dim, torch.float32, DEVICE)
    for layer in range(len(specs)):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    seq_lens, extend_lens = [50, 33, 7, 41], [20, 33, 1, 2]
    table = torch.zeros(len(seq_lens), 64, dtype=torch.int32)
    scattered = torch.randperm(400, generator=gen) + 600
    for row in range(len(seq_lens)):  # rows 0 and 2: runs from slots 0 and 200; 1 and 3 scattered
        table[row] = torch.arange(64) + row * 100 if row % 2 == 0 else scattered[row * 64 : (row + 1) * 64]
    out_loc = torch.cat([table[r, s - e : s] for r, (s, e) in enumerate(zip(seq_lens, extend_lens))]).long()

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    batch = ForwardBatch(
        phase="extend", input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=DEVICE),
        positions=torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)]).to(DEVICE),
        out_loc=out_loc.to(DEVICE), rows=torch.arange(len(seq_lens), device=DEVICE), seq_lens=i32(seq_lens),
        extend_lens=i32(extend_lens), extend_starts=i32([sum(extend_lens[:i]) for i in range(len(seq_lens))]),
        token_table=table.to(DEVICE), seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens,
        sample_idx=torch.zeros(1, dtype=torch.int64, device=DEVICE),
    )  # fmt: skip
    q = torch.randn(len(out_loc), heads, head_dim, generator=gen).to(DEVICE)
    kv = [torch.randn(len(out_loc), kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2)]
    outs = {}
    backends = {"torch": TorchAttnBackend(pool, heads, kv_heads, head_dim, 0.3),
                "triton": create_triton_backend(pool, heads, kv_heads, head_dim, 0.3)}  # fmt: skip
    for name, backend in backends.items():
        for layer, spec in enumerate(specs):
            backend.configure_layer(layer, spec)
        backend.prepare(batch)
        if name == "triton":
            bases = batch.attn_meta.kv_bases
            # The mixed step's extend part: rows 0, 1 and 3 (row 2 extends by one token).
            assert (bases is None) if kv_load == "gather" else bases.tolist() == [0, -1, -1]
        outs[name] = [backend.forward(q, kv[0], kv[1], layer, batch).clone() for layer in range(len(specs))]
        batch.attn_meta = None
    for layer in range(len(specs)):
        assert_close(outs["triton"][layer], outs["torch"][layer], torch.float32)
