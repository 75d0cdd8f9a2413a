"""LoRA pieces without a model: adapter checks, the per-layer slot layout under tensor
parallelism (each rank's share sums to the full delta), slot assignment and unload draining,
and the prefix cache's per-adapter namespaces."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from minisgl.distributed import TPInfo, set_tp_info
from minisgl.kvcache.radix import RadixPrefixCache
from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.lora.adapter import AdapterNotFoundError, read_adapter
from minisgl.lora.layer import LoraLinear, LoraSegments, LoraStepState
from minisgl.lora.manager import LoraManager, UnknownAdapterError

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 16, 4, 4, 2, 24


def _write_adapter(path: Path, rank: int, modules: dict[str, tuple[int, int]], seed: int = 0,
                   **config: object) -> None:  # fmt: skip
    """An adapter in PEFT's file layout: module -> (in_features, out_features)."""
    gen = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": targets, **config}))  # fmt: skip


def test_adapter_config_checks(tmp_path: Path) -> None:
    _write_adapter(tmp_path / "rs", 4, {"model.layers.0.self_attn.q_proj": (HIDDEN, 16)}, use_rslora=True)
    weights = read_adapter(str(tmp_path / "rs"), max_rank=8)
    assert weights.config.scaling == pytest.approx(8 / 2.0)  # alpha / sqrt(r)
    raw = read_adapter(str(tmp_path / "rs"), 8).modules["model.layers.0.self_attn.q_proj"]
    assert raw[0].shape == (4, HIDDEN) and raw[1].shape == (16, 4)
    with pytest.raises(ValueError, match="greater than max_lora_rank 2"):
        read_adapter(str(tmp_path / "rs"), max_rank=2)
    with pytest.raises(AdapterNotFoundError):
        read_adapter(str(tmp_path / "none"), max_rank=8)
    _write_adapter(tmp_path / "dora", 2, {"model.layers.0.mlp.up_proj": (HIDDEN, INTER)}, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        read_adapter(str(tmp_path / "dora"), 8)
    _write_adapter(tmp_path / "head", 2, {"lm_head": (HIDDEN, 50)})
    with pytest.raises(ValueError, match="not supported"):
        read_adapter(str(tmp_path / "head"), 8)


def _segments(num_tokens: int, slot: int = 0) -> LoraSegments:
    one = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    return LoraSegments([0], [num_tokens], [slot], one(0), one(num_tokens), one(slot))


def _delta(layer_cls: str, x: torch.Tensor, parts: dict, rank: int, size: int) -> torch.Tensor:  # type: ignore[type-arg]
    """Output of one rank's layer (zero base weights) with the adapter in slot 0."""
    set_tp_info(TPInfo(rank, size))
    try:
        if layer_cls == "qkv":
            layer: nn.Module = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False)
        elif layer_cls == "gate_up":
            layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
        else:
            layer = RowParallelLinear(INTER, HIDDEN)
        layer.weight.data.zero_()
        state = LoraStepState()
        delta = LoraLinear(layer, state, max_loras=2, max_rank=4, use_triton=False)  # type: ignore[arg-type]
        delta.set_slot(0, delta.host_weights(layer_cls, parts))
        state.segments = _segments(x.shape[0])
        layer_x = x if layer_cls != "down" else x.narrow(1, rank * (INTER // size), INTER // size)
        out = layer._linear(layer_x, layer.weight) if layer_cls == "down" else layer._linear(layer_x, layer.weight, None)
        delta.add_(layer_x, out)
        return out
    finally:
        set_tp_info(TPInfo())


@pytest.mark.parametrize("size", [1, 2, 4])
def test_tp_shards_sum_to_the_full_delta(size: int) -> None:
    """Column-parallel: A whole, this rank's rows of B (kv heads replicated at TP=4); row-parallel:
    this rank's columns of A, B whole, partial deltas summed (the all-reduce)."""
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(5, HIDDEN, generator=gen)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k = (rnd(3, HIDDEN), rnd(HEADS * HEAD_DIM, 3)), (rnd(2, HIDDEN), rnd(KV_HEADS * HEAD_DIM, 2))
    outs = [_delta("qkv", x, {"q": q, "k": k}, r, size) for r in range(size)]
    q_per, kv_per = HEADS * HEAD_DIM // size, max(1, KV_HEADS // size) * HEAD_DIM
    full_q, full_k = x @ q[0].t() @ q[1].t(), x @ k[0].t() @ k[1].t()
    torch.testing.assert_close(torch.cat([o[:, :q_per] for o in outs], 1), full_q)
    replicas = max(1, size // KV_HEADS)
    for r, out in enumerate(outs):
        shard = r // replicas
        torch.testing.assert_close(out[:, q_per : q_per + kv_per], full_k[:, shard * kv_per : (shard + 1) * kv_per])
        assert torch.equal(out[:, q_per + kv_per :], torch.zeros_like(out[:, q_per + kv_per :]))  # v: untrained
    up = (rnd(4, HIDDEN), rnd(INTER, 4))
    outs = [_delta("gate_up", x, {1: up}, r, size) for r in range(size)]
    per = INTER // size
    torch.testing.assert_close(torch.cat([o[:, per:] for o in outs], 1), x @ up[0].t() @ up[1].t())
    assert all(torch.equal(o[:, :per], torch.zeros(5, per)) for o in outs)
    h = torch.randn(5, INTER, generator=gen)
    down = (rnd(4, INTER), rnd(HIDDEN, 4))
    partial = sum(_delta("down", h, {None: down}, r, size) for r in range(size))
    torch.testing.assert_close(partial, h @ down[0].t() @ down[1].t())


class _Tiny(nn.Module):
    """The module names of a one-layer decoder: what the manager maps adapter modules onto."""

    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False)
        layer.self_attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.config = None


def _model() -> tuple[nn.Module, Callable[[str], tuple[str, str | int | None] | None]]:
    from minisgl.models.loader import target_of

    model = _Tiny()
    return model, lambda name: target_of(model, name)


def _manager(tmp_path: Path, names: list[str], max_loras: int = 2) -> LoraManager:
    manager = LoraManager(*_model(), max_loras=max_loras, max_rank=4, use_triton=False)
    for i, name in enumerate(names):
        _write_adapter(tmp_path / name, 2, {"model.layers.0.self_attn.q_proj": (HIDDEN, 16),
                                            "model.layers.0.self_attn.o_proj": (16, HIDDEN)}, seed=i)  # fmt: skip
        manager.load(name, str(tmp_path / name))
    return manager


def test_slots_are_pinned_shared_and_reused(tmp_path: Path) -> None:
    manager = _manager(tmp_path, ["a", "b", "c"])
    a, b, c = (manager.ref(n) for n in "abc")
    assert manager.acquire(a) and manager.acquire(a) and manager.acquire(b)
    assert not manager.acquire(c), "both slots are pinned: c waits"
    qkv = manager.layers["model.layers.0.self_attn.qkv_proj"]
    slot_a = manager.adapters[a].slot
    assert slot_a is not None and qkv.a[slot_a].abs().sum() > 0
    manager.release(b)
    assert manager.acquire(c), "b's slot is free to reuse once unpinned"
    assert manager.adapters[b].slot is None and manager.adapters[c].slot is not None
    manager.prepare([(a, 3), (None, 2), (c, 1), (c, 4), (a, 1)])
    seg = manager.state.segments
    assert seg is not None and (seg.starts, seg.lens) == ([0, 5, 10], [3, 5, 1])
    assert seg.slots == [slot_a, manager.adapters[c].slot, slot_a]
    manager.prepare([(None, 4)])
    assert manager.state.segments is None, "a batch of the base model alone skips every delta"


def test_unload_waits_for_its_requests(tmp_path: Path) -> None:
    manager = _manager(tmp_path, ["a"])
    uid = manager.ref("a")
    assert manager.acquire(uid)
    manager.unload("a")
    with pytest.raises(UnknownAdapterError):
        manager.ref("a")
    assert uid in manager.adapters, "weights stay while a request uses them"
    manager.release(uid)
    manager.unref(uid)
    assert uid not in manager.adapters and manager.slots == [None, None]
    with pytest.raises(UnknownAdapterError, match="cannot be found"):
        manager.unload("a")
    manager.load("a", str(tmp_path / "a"))
    assert manager.names["a"] != uid, "a reload is a new namespace"


def test_adapter_for_another_model_is_refused(tmp_path: Path) -> None:
    manager = LoraManager(*_model(), max_loras=1, max_rank=4, use_triton=False)
    _write_adapter(tmp_path / "mlp", 2, {"model.layers.0.mlp.down_proj": (INTER, HIDDEN)})
    with pytest.raises(ValueError, match="not a projection of this model"):
        manager.load("mlp", str(tmp_path / "mlp"))
    _write_adapter(tmp_path / "wide", 2, {"model.layers.0.self_attn.q_proj": (HIDDEN + 1, 16)})
    with pytest.raises(ValueError, match="features"):
        manager.load("wide", str(tmp_path / "wide"))
    assert not manager.names


def test_radix_namespaces_never_share() -> None:
    cache = RadixPrefixCache(page_size=2)
    tokens = [1, 2, 3, 4]
    base = cache.insert(tokens, [10, 11])
    assert cache.match(tokens, namespace=7).pages == []
    mine = cache.insert(tokens, [20, 21], namespace=7)
    assert mine.pages == [20, 21] and mine.pages_to_free == []
    assert cache.match(tokens).pages == [10, 11] and cache.match(tokens, namespace=7).pages == [20, 21]
    cache.lock(mine.handle)
    cache.lock(cache.match([9, 9], namespace=7).handle)  # a namespace's root: nothing to pin
    cache.check_invariants()
    assert sorted(cache.evict(4)) == [10, 11], "only the unlocked namespace's pages go"
    cache.unlock(mine.handle)
    cache.check_invariants()
    assert cache.cached_pages == 2 and sorted(cache.reset()) == [20, 21]
    assert cache.match(tokens, namespace=7).pages == [] and base.pages == [10, 11]
