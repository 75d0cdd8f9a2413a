"""The engine's adapters: names, host copies, and the `max_loras` device slots they take turns in.

An adapter is loaded once (host tensors, already in each layer's slot layout) and gets a uid
that also names its prefix-cache namespace, so a reload under the same name never meets the old
one's KV. The scheduler keeps two counts per adapter: `ref` for every request it holds (waiting
or resident) and `acquire`/`release` for resident ones, which pin its slot. A request is
admitted only once its adapter has a slot: a free one, or the least recently used unpinned one.
`unload` removes the name at once (later requests naming it are refused) and drops the weights
when the last request using them leaves, so unloading never fails a request in flight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.lora.adapter import AdapterWeights, read_adapter
from minisgl.lora.layer import LoraLinear, LoraSegments, LoraStepState, Part
from minisgl.utils.logging import get_logger

logger = get_logger(__name__)

TargetOf = Callable[[str], "tuple[str, Part] | None"]


class UnknownAdapterError(ValueError):
    """A request or an unload names no loaded adapter (HTTP 404)."""

    status = 404


@dataclass
class _Loaded:
    name: str
    path: str
    rank: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> host (A, B) in slot layout
    refs: int = 0  # requests the scheduler holds that use it
    pins: int = 0  # resident ones among them (their slot cannot be reused)
    unloaded: bool = False
    last_use: int = 0
    slot: int | None = None


class LoraManager:
    def __init__(self, model: nn.Module, target_of: TargetOf, max_loras: int, max_rank: int, use_triton: bool) -> None:
        """`target_of` maps a checkpoint tensor name to its (parameter, fused part), as the model's
        loader does (models/loader.py: the fused qkv / gate_up parts)."""
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.state = LoraStepState()
        self._target_of = target_of
        self.layers: dict[str, LoraLinear] = {}
        for name, module in model.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                if module.weight_held_by_fn:
                    raise ValueError("LoRA adapters need float weights: pass --weights float32 (not gguf)")
                module.lora = delta = LoraLinear(module, self.state, max_loras, max_rank, use_triton)
                self.layers[name] = delta
        self.names: dict[str, int] = {}
        self.adapters: dict[int, _Loaded] = {}
        self.slots: list[int | None] = [None] * max_loras
        self._uids = itertools.count(1)
        self._clock = itertools.count(1)
        self._device = next(model.parameters()).device

    # ------------------------------------------------------------------ adapters
    def load(self, name: str, path: str) -> int:
        """Read and check the adapter at `path` under `name`; returns its uid. ValueError (nothing
        loaded) for a name in use, a missing or unsupported adapter, or a rank over the cap."""
        if name in self.names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        weights = read_adapter(path, self.max_rank)
        layers = self._layout(weights)
        uid = next(self._uids)
        self.adapters[uid] = _Loaded(name, path, weights.config.rank, layers)
        self.names[name] = uid
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d layers)", name, path, weights.config.rank, len(layers))
        return uid

    def _layout(self, weights: AdapterWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        by_layer: dict[str, dict[Part, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in weights.modules.items():
            target = self._target_of(module + ".weight")
            layer = target[0].removesuffix(".weight") if target is not None else None
            if layer is None or layer not in self.layers:
                raise ValueError(f"{weights.path}: {module} is not a projection of this model")
            by_layer.setdefault(layer, {})[target[1]] = pair  # type: ignore[index]
        return {layer: self.layers[layer].host_weights(layer, parts) for layer, parts in by_layer.items()}

    def unload(self, name: str) -> None:
        """Forget `name`; its weights go once no request uses them. UnknownAdapterError if absent."""
        uid = self.names.pop(name, None)
        if uid is None:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        adapter = self.adapters[uid]
        adapter.unloaded = True
        if adapter.refs == 0:
            self._drop(uid)
        else:
            logger.info("LoRA adapter %r unloaded; its %d requests finish first", name, adapter.refs)

    def _drop(self, uid: int) -> None:
        adapter = self.adapters.pop(uid)
        if adapter.slot is not None:
            self.slots[adapter.slot] = None

    def listed(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter loaded now, in load order."""
        return [(name, self.adapters[uid].path) for name, uid in self.names.items()]

    # ------------------------------------------------------------------ the scheduler's counts
    def ref(self, name: str) -> int:
        """A new request names adapter `name`: its uid (UnknownAdapterError if not loaded)."""
        uid = self.names.get(name)
        if uid is None:
            raise UnknownAdapterError(f"The model '{name}' does not exist.")
        self.adapters[uid].refs += 1
        return uid

    def unref(self, uid: int) -> None:
        adapter = self.adapters[uid]
        assert adapter.refs > 0
        adapter.refs -= 1
        if adapter.refs == 0 and adapter.unloaded:
            self._drop(uid)

    def acquire(self, uid: int) -> bool:
        """Pin the adapter's slot for a request being admitted, loading it into a free or the
        least recently used unpinned slot; False when every slot is pinned (the request waits)."""
        adapter = self.adapters[uid]
        adapter.last_use = next(self._clock)
        if adapter.slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            for name, delta in self.layers.items():
                delta.set_slot(slot, adapter.layers.get(name))
            self.slots[slot] = uid
            adapter.slot = slot
        adapter.pins += 1
        return True

    def release(self, uid: int) -> None:
        adapter = self.adapters[uid]
        assert adapter.pins > 0
        adapter.pins -= 1

    def _free_slot(self) -> int | None:
        for slot, owner in enumerate(self.slots):
            if owner is None:
                return slot
        idle = [uid for uid in self.slots if uid is not None and self.adapters[uid].pins == 0]
        if not idle:
            return None
        victim = self.adapters[min(idle, key=lambda uid: self.adapters[uid].last_use)]
        freed = victim.slot
        assert freed is not None
        victim.slot = None
        self.slots[freed] = None
        return freed

    # ------------------------------------------------------------------ one step
    def prepare(self, runs: Sequence[tuple[int | None, int]]) -> None:
        """This step's segments: `runs` lists (adapter uid or None, token count) request by
        request, in the batch's token order (padding after them belongs to none)."""
        starts: list[int] = []
        lens: list[int] = []
        slots: list[int] = []
        pos = 0
        for uid, count in runs:
            if uid is not None:
                slot = self.adapters[uid].slot
                assert slot is not None, "a request with an adapter ran without its slot"
                if slots and slots[-1] == slot and starts[-1] + lens[-1] == pos:
                    lens[-1] += count
                else:
                    starts.append(pos)
                    lens.append(count)
                    slots.append(slot)
            pos += count
        if not starts:
            self.state.segments = None
            return
        device = self._device
        as_t = lambda v: torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        self.state.segments = LoraSegments(starts, lens, slots, as_t(starts), as_t(lens), as_t(slots))
