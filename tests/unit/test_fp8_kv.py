"""FP8 KV cache on the torch backend: the pool stores k/scale saturated to float8 (and reads
back within e4m3's rounding), attention over a float8 pool equals dense attention over the
dequantized pages (extend over a cached prefix, per-request and padded decode, windows, soft-cap,
non-unit scales), the engine's pool holds twice the tokens per GiB, the checkpoint's per-layer
scales reach the pool, and batched greedy output equals single-request output with pages back in
the pool afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams
from minisgl.attention.base import AttnLayerSpec
from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMeta
from minisgl.kvcache.pool import FP8_MAX, KVPool
from minisgl.models.loader import kv_scale_target
from tests.golden.test_families_attention import HEADS, HEAD_DIM, KV_HEADS, PAGE, SCALE, SPECS, _reference, _setup
from tests.tiny_models import make_tiny_model

FP8 = torch.float8_e4m3fn


def test_store_quantizes_with_the_layer_scale() -> None:
    pool = KVPool(2, 4, PAGE, KV_HEADS, HEAD_DIM, FP8, torch.device("cpu"))
    pool.set_scales({1: (0.5, 4.0)})
    assert (pool.k_scale, pool.v_scale) == ([1.0, 0.5], [1.0, 4.0])
    x = torch.randn(3, KV_HEADS, HEAD_DIM) * 200  # some values saturate at 448 * scale
    loc = torch.tensor([5, 0, 9])
    pool.store(1, loc, x, x)
    assert torch.equal(pool.k[1][loc].view(torch.uint8), (x * 2.0).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8))
    back = pool.v[1][loc].float() * 4.0
    torch.testing.assert_close(back, x, rtol=2**-3, atol=1e-6)  # e4m3: 3 mantissa bits
    assert pool.k[0].float().abs().sum() == 0  # other layers untouched
    with pytest.raises(ValueError, match="positive"):
        pool.set_scales({0: (0.0, 1.0)})


def test_pool_bytes_halve() -> None:
    args = (2, PAGE, KV_HEADS, HEAD_DIM)
    assert KVPool.bytes_per_page(*args, FP8) * 2 == KVPool.bytes_per_page(*args, torch.bfloat16)


def _fp8_copy(pool: KVPool, k_scale: float, v_scale: float) -> tuple[KVPool, KVPool]:
    """`pool`'s contents quantized into a float8 pool, and the dequantized fp32 pool the
    reference attends over."""
    q8 = KVPool(1, pool.num_pages, PAGE, KV_HEADS, HEAD_DIM, FP8, torch.device("cpu"))
    q8.set_scales({0: (k_scale, v_scale)})
    q8.k[0].copy_(q8.quantize(pool.k[0] * 3, k_scale))
    q8.v[0].copy_(q8.quantize(pool.v[0] * 3, v_scale))
    deq = KVPool(1, pool.num_pages, PAGE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    deq.k[0].copy_(q8.k[0].float() * k_scale)
    deq.v[0].copy_(q8.v[0].float() * v_scale)
    return q8, deq


def _store_new(pool: KVPool, deq: KVPool, batch, k: torch.Tensor, v: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """What the backend's store does to the new tokens, mirrored into the reference pool."""
    deq.k[0][batch.out_loc] = pool.quantize(k, pool.k_scale[0]).float() * pool.k_scale[0]
    deq.v[0][batch.out_loc] = pool.quantize(v, pool.v_scale[0]).float() * pool.v_scale[0]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"w{s.sliding_window}-cap{s.logit_cap}")
@pytest.mark.parametrize("case", ["extend", "decode", "decode-padded"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_attention_over_fp8_pages_equals_dequantized(spec: AttnLayerSpec, case: str, scales: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(3)
    if case == "extend":
        seq_lens, ext = [11, 32, 4, 17], [11, 12, 4, 1]
    else:
        seq_lens, ext = [3, 9, 30], [1, 1, 1]
    pool, batch, q, k, v = _setup(seq_lens, ext, gen)
    q8, deq = _fp8_copy(pool, *scales)
    _store_new(q8, deq, batch, k, v)
    backend = TorchAttnBackend(q8, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.configure_layer(0, spec)
    backend.prepare(batch)
    if case == "decode-padded":
        meta = TorchAttnMeta(batch)
        backend.pad_decode(meta)
        batch.attn_meta = meta
    out = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(out, _reference(deq, batch, q, spec), rtol=1e-5, atol=1e-5)
    # and the pages really are float8: the answer differs from attending over the fp32 values
    assert not torch.allclose(out, _reference(pool, batch, q, spec), atol=1e-4)


def test_kv_scale_names() -> None:
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.0.self_attn.v_proj.output_scale") == (0, "v")
    assert kv_scale_target("model.layers.12.self_attn.kv_scale") == (12, "kv")
    assert kv_scale_target("model.layers.3.self_attn.k_proj.weight") is None
    assert kv_scale_target("model.layers.3.self_attn.k_proj.weight_scale") is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-fp8kv")
    make_tiny_model("llama", path)
    return path


def test_engine_pool_holds_twice_the_tokens_and_reads_checkpoint_scales(tiny: Path, tmp_path: Path) -> None:
    plain = LLM(str(tiny), device="cpu", dtype="bfloat16", kv_cache_gb=0.001)
    pages = plain.engine.pool.num_pages
    del plain
    # The same weights plus per-layer KV scales, as an FP8-KV checkpoint carries them.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in tiny.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (ckpt / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(2.0)
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(tensors, str(ckpt / "model.safetensors"))
    fp8 = LLM(str(ckpt), device="cpu", dtype="bfloat16", kv_cache_gb=0.001, kv_cache_dtype="fp8_e4m3")
    pool = fp8.engine.pool
    assert pool.dtype == FP8 and pool.k[0].dtype == FP8
    assert abs(pool.num_pages - 2 * pages) <= 1, (pool.num_pages, pages)
    assert (pool.k_scale, pool.v_scale) == ([0.25, 0.5], [1.0, 2.0])
    out = fp8.generate([[1, 5, 9, 33, 70]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_unknown_kv_cache_dtype_is_a_clear_error(tiny: Path) -> None:
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        LLM(str(tiny), device="cpu", kv_cache_dtype="int4")


def test_batched_equals_single_and_pages_return(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", kv_cache_dtype="fp8_e4m3", num_pages=64)
    prompts = [[1, 5, 9, 33, 70, 2, 8] * k for k in (1, 3, 6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == single
    llm.scheduler.check_idle_invariants()
    llm.scheduler.flush_cache()
    assert llm.scheduler.allocator.num_free == llm.scheduler.allocator.num_pages


def test_scales_measured_at_start_without_checkpoint_scales(tiny: Path) -> None:
    """No KV scales in the checkpoint: a calibration prefill sets them (the same on every start,
    mapping the largest k/v it saw to 448 / HEADROOM); off, they stay 1.0."""
    from minisgl.engine.kv_scales import HEADROOM

    first = LLM(str(tiny), device="cpu", kv_cache_dtype="fp8_e4m3", num_pages=64).engine.pool
    again = LLM(str(tiny), device="cpu", kv_cache_dtype="fp8_e4m3", num_pages=64).engine.pool
    assert first.k_scale == again.k_scale and first.v_scale == again.v_scale
    assert all(s != 1.0 for s in first.k_scale + first.v_scale)
    for layer in range(first.num_layers):
        # The calibration prefill stored its k/v at scale 1.0 in the first 512 slots: its amax
        # (to float8 rounding) times HEADROOM / 448 is the scale.
        for cache, scale in ((first.k[layer], first.k_scale[layer]), (first.v[layer], first.v_scale[layer])):
            amax = cache[:512].float().abs().max().item()
            assert amax > 0
            torch.testing.assert_close(scale, amax * HEADROOM / FP8_MAX, rtol=2**-3, atol=0)
    unit = LLM(str(tiny), device="cpu", kv_cache_dtype="fp8_e4m3", num_pages=64, calculate_kv_scales=False).engine.pool
    assert unit.k_scale == [1.0] * unit.num_layers and unit.v_scale == [1.0] * unit.num_layers


# The Triton path (run here under the interpreter): its store equals the reference store bit for
# bit, and its kernels over float8 pages equal the torch backend over the same pages. Triton 3.6's
# interpreter rounds float32 -> float8 wrongly just below a power of two (-7.9995 gives -4.0, not
# -8.0; the GPU converts in hardware), so these tests store values float8 holds exactly, times
# power-of-two scales: scaling, saturation and placement are checked here, rounding on the GPU
# (tests/kernels/test_attention_kernels.py::test_store_kv_fp8_gpu).
POW2_SCALES = (0.03125, 0.25)


def _fp8_exact(shape: tuple[int, ...], scale: float, gen: torch.Generator) -> torch.Tensor:
    """Random values whose quotient by `scale` float8 holds exactly (some saturate at 448)."""
    values = (torch.randn(shape, generator=gen) * 150).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    values[0, 0, :2] = torch.tensor([900.0, -2000.0])  # past 448: saturated by the store
    return values * scale


def test_triton_store_equals_reference() -> None:
    from minisgl.kernels.store_kv import store_kv, store_kv_ref

    gen = torch.Generator().manual_seed(4)
    kv = torch.stack([_fp8_exact((7, KV_HEADS, HEAD_DIM), s, gen) for s in POW2_SCALES], dim=1)
    loc = torch.randperm(40, generator=gen)[:7]
    caches = [torch.zeros(40, KV_HEADS, HEAD_DIM, dtype=FP8) for _ in range(4)]
    store_kv(kv[:, 0], kv[:, 1], caches[0], caches[1], loc, *POW2_SCALES)
    store_kv_ref(kv[:, 0], kv[:, 1], caches[2], caches[3], loc, *POW2_SCALES)
    for got, want in zip(caches[:2], caches[2:]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    pool = KVPool(1, 10, PAGE, KV_HEADS, HEAD_DIM, FP8, torch.device("cpu"))
    pool.set_scales({0: POW2_SCALES})
    pool.store(0, loc, kv[:, 0], kv[:, 1])  # the torch backend's store: the same bytes
    assert torch.equal(pool.k[0][:40].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(pool.v[0][:40].view(torch.uint8), caches[1].view(torch.uint8))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"w{s.sliding_window}-cap{s.logit_cap}")
@pytest.mark.parametrize("case", ["extend", "decode"])
def test_triton_over_fp8_pages_equals_torch_backend(spec: AttnLayerSpec, case: str) -> None:
    from minisgl.attention.triton_backend import TritonAttnBackend

    seq_lens, ext = ([11, 32, 4, 17], [11, 12, 4, 1]) if case == "extend" else ([3, 9, 30], [1, 1, 1])
    outs = []
    for backend_cls in (TorchAttnBackend, TritonAttnBackend):
        gen = torch.Generator().manual_seed(5)
        pool, batch, q, k, v = _setup(seq_lens, ext, gen)
        q8, _ = _fp8_copy(pool, *POW2_SCALES)
        k, v = _fp8_exact(tuple(k.shape), POW2_SCALES[0], gen), _fp8_exact(tuple(v.shape), POW2_SCALES[1], gen)
        backend = backend_cls(q8, HEADS, KV_HEADS, HEAD_DIM, SCALE)
        backend.configure_layer(0, spec)
        backend.prepare(batch)
        outs.append((backend.forward(q, k, v, 0, batch).reshape(q.shape), q8))
    (torch_out, torch_pool), (triton_out, triton_pool) = outs
    assert torch.equal(torch_pool.k[0].view(torch.uint8), triton_pool.k[0].view(torch.uint8))  # same stores
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("row_norm", [False, True])
def test_rotary_store_into_fp8_equals_rotary_then_store(dtype: torch.dtype, norm: bool, row_norm: bool) -> None:
    """The fused rotary + KV store over a float8 cache (what lets a float8 pool keep the folded
    norms and skip the store launch) writes the bytes `store_kv` writes from the rotary's output
    in the compute dtype, with non-unit scales and saturation; q is unchanged by the cache."""
    from minisgl.kernels.rotary import rotary_store_kv
    from minisgl.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(6)
    tokens, num_q, num_k, head_dim, slots = 5, 4, 2, 32, 23
    q, k, v = ((torch.randn(tokens, h, head_dim, generator=gen) * 3).to(dtype) for h in (num_q, num_k, num_k))
    v[0, 0, :2] = torch.tensor([900.0, -2000.0]).to(dtype)  # saturated at +-448 once divided by 0.5
    cos = torch.randn(64, head_dim // 2, generator=gen)
    sin = torch.randn(64, head_dim // 2, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    out_loc = torch.randperm(slots, generator=gen)[:tokens]
    norms = None
    if norm:
        weights = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)]
        norms = (weights[0], weights[1], 1e-6, 1e-5)
    rows = ((3 * torch.randn(tokens, 40, generator=gen)).to(dtype), 1e-6) if row_norm else None
    scales = (0.011, 0.5)
    # The reference: the rotary's k and v in the compute dtype, then the float8 store kernel.
    k16, v16 = (torch.zeros(slots, num_k, head_dim, dtype=dtype) for _ in range(2))
    q_want = rotary_store_kv(positions, q, k, v, cos, sin, k16, v16, out_loc, norms, rows)
    k_want, v_want = (torch.zeros(slots, num_k, head_dim, dtype=FP8) for _ in range(2))
    store_kv(k16[out_loc], v16[out_loc], k_want, v_want, out_loc, *scales)
    k8, v8 = (torch.zeros(slots, num_k, head_dim, dtype=FP8) for _ in range(2))
    q_got = rotary_store_kv(positions, q, k, v, cos, sin, k8, v8, out_loc, norms, rows, scales)
    assert torch.equal(q_got, q_want)
    assert torch.equal(k8.view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v_want.view(torch.uint8))
    assert v8[out_loc[0], 0, :2].float().tolist() == [448.0, -448.0]
    assert k8.float().abs().max() > 100  # k / 0.011: the scale was applied


@pytest.mark.parametrize("route", ["q", "q-staged", "f16", "f16-staged"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_fp8_routes_equal_dequantized(route: str, splits: int) -> None:
    """Each way of widening float8 tiles in the decode kernel (`decode.FP8_ROUTES`) attends as
    the reference over the dequantized pages: exactly for q's dtype (fp32 here), within f16's
    rounding of the probabilities for the f16 dots (q holds bf16 values, which f16 keeps exactly)."""
    from minisgl.kernels.attention import decode_attention
    from minisgl.kernels.attention_ref import decode_attention_ref

    gen = torch.Generator().manual_seed(8)
    slots, lens = 700, [200, 37, 1]
    k = (torch.randn(slots, 2, 32, generator=gen) / 0.02).clamp(-448, 448).to(FP8)
    v = (torch.randn(slots, 2, 32, generator=gen) / 0.01).clamp(-448, 448).to(FP8)
    table = torch.randperm(slots, generator=gen)[: 3 * 200].view(3, 200).int()
    rows, seq_lens = torch.tensor([2, 0, 1]), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 4, 32, generator=gen).bfloat16().float()
    want = decode_attention_ref(q, k.float() * 0.02, v.float() * 0.01, table, rows, seq_lens, 32**-0.5)
    got = decode_attention(q, k, v, table, rows, seq_lens, 32**-0.5, num_splits=splits, k_scale=0.02, v_scale=0.01,
                           fp8_route=route)  # fmt: skip
    tol = 1e-5 if route.startswith("q") else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if route.startswith("f16"):  # a 16-bit q takes the same dots by default (FP8_ROUTE)
        got16 = decode_attention(q.half(), k, v, table, rows, seq_lens, 32**-0.5, num_splits=splits,
                                 k_scale=0.02, v_scale=0.01, fp8_route=route)  # fmt: skip
        torch.testing.assert_close(got16.float(), want, rtol=4e-3, atol=4e-3)


def test_graph_launch_of_a_float8_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float8 cache takes its own measured launch (GRAPH_TUNED_FP8) where the table has one,
    else the split count of the 16-bit one of the same GPU, shape and size with the float8 default
    tile (decode_attention's); fp32 pages never take either."""
    import minisgl.kernels.attention.decode as decode
    import minisgl.kernels.attention.tuned as tuned
    from minisgl.kernels.attention import DecodeLaunch, decode_num_splits

    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(tuned, "device_name", lambda device: "NVIDIA H200")
    cuda = torch.device("cuda", 0)  # only its type is read
    key = ("NVIDIA H200", 8, 16, 128)
    sixteen = tuned.GRAPH_TUNED[key]
    size = next(iter(sixteen))
    monkeypatch.setattr(tuned, "GRAPH_TUNED_FP8", {})
    assert tuned.decode_graph_launch(size, 16, 8, 128, FP8, cuda) == DecodeLaunch(sixteen[size].num_splits)
    own = DecodeLaunch(2, 128, 4, 3)
    monkeypatch.setattr(tuned, "GRAPH_TUNED_FP8", {key: {size: own}})
    assert tuned.decode_graph_launch(size, 16, 8, 128, FP8, cuda) == own
    assert tuned.decode_graph_launch(size, 16, 8, 128, torch.bfloat16, cuda) == sixteen[size]
    heuristic = DecodeLaunch(decode_num_splits(size, 8, 128, None, cuda))
    assert tuned.decode_graph_launch(size, 16, 8, 128, torch.float32, cuda) == heuristic
    assert tuned.decode_graph_launch(size, 16, 8, 128, FP8, cuda, tuned=False) == heuristic


def test_folded_norms_over_a_float8_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float8 pool keeps the folded norms (the fused rotary store scales and saturates). Through
    the whole engine (Triton kernels interpreted, fp32): the folded Triton layers give the logits
    and the float8 pages of the unfolded ones, and their first layer's pages are those the torch
    backend stores (`KVPool.store`) from the same inputs, but for the interpreter's float8 rounding
    just below powers of two (see POW2_SCALES). Later layers are not compared with the torch
    backend: a flipped float8 byte changes the next layer's inputs, and this tiny random model
    amplifies that (0.9 in its logits; torch over float8 vs fp32 pages: 0.4)."""
    import random

    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.layers import activation, norm, rotary
    from minisgl.platform.kernel_config import KernelConfig
    from tests.engine_helpers import forward_logits

    for module in (norm, activation, rotary):  # the Triton layers, as on CUDA
        monkeypatch.setattr(module, "resolve_impl", lambda _impl, _device: "triton")
    make_tiny_model("qwen3", tmp_path)
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 3, 17)]
    # 32 pages: each engine's calibration prefill fills the pool (128 tokens), through the
    # interpreted Triton layers; 64 pages took 65 s against 39 (the page shares below: 0.4-0.5 %).
    engines = [
        Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", attn=attn, page_size=4,
                            num_pages=32, max_running_requests=4, cuda_graph_max_bs=0, kv_cache_dtype="fp8_e4m3",
                            kernels=KernelConfig(fold_norms=fold)))  # fmt: skip
        for attn, fold in (("triton", True), ("triton", False), ("torch", False))
    ]
    folded, plain, torch_backend = engines
    assert folded.model.model.norms_folded and not plain.model.model.norms_folded
    assert folded.pool.k_scale == torch_backend.pool.k_scale and folded.pool.k_scale[0] != 1.0  # calibrated
    got, want, _ = (forward_logits(e, prompts, all_positions=True) for e in engines)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)

    def differ(a: torch.Tensor, b: torch.Tensor) -> float:
        """The share of the written float8 bytes of b that a does not hold."""
        written = b.view(torch.uint8) != 0
        assert written.float().mean() > 0.05
        return ((a.view(torch.uint8) != b.view(torch.uint8)) & written).float().sum().item() / written.sum().item()

    for layer in range(folded.pool.num_layers):
        assert differ(folded.pool.k[layer], plain.pool.k[layer]) < 0.005
        assert differ(folded.pool.v[layer], plain.pool.v[layer]) < 0.005
    assert differ(folded.pool.k[0], torch_backend.pool.k[0]) < 0.01
    assert differ(folded.pool.v[0], torch_backend.pool.v[0]) < 0.01
