"""Layers that rotate alike share one cos/sin table (one copy per model, not one per layer)."""

from __future__ import annotations

import torch

from minisgl.layers.rotary import RotaryEmbedding, _angles

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def test_layers_share_one_table_with_the_same_values() -> None:
    layers = [RotaryEmbedding(64, 1024, 10000.0, None) for _ in range(3)]
    assert len({layer.cos.untyped_storage().data_ptr() for layer in layers}) == 1
    assert layers[0].cos.untyped_storage().data_ptr() == layers[0].sin.untyped_storage().data_ptr()
    freqs, factor = _angles(64, 1024, 10000.0, None)
    for layer in layers:
        assert layer.cos.is_contiguous() and layer.sin.is_contiguous() and layer.cos.dtype == torch.float32
        assert torch.equal(layer.cos, freqs.cos() * factor) and torch.equal(layer.sin, freqs.sin() * factor)


def test_layers_built_under_inference_mode_share_one_table() -> None:
    """The engine builds its model under inference mode, where a view records no base: the
    table's Python object (what the weak cache holds) must not die with the call that made it."""
    with torch.inference_mode():
        layers = [RotaryEmbedding(64, 1024, 10000.0, None) for _ in range(3)]
    assert len({layer.cos.untyped_storage().data_ptr() for layer in layers}) == 1
    assert len({layer.sin.data_ptr() for layer in layers}) == 1


def test_different_ropes_get_their_own_tables() -> None:
    plain = RotaryEmbedding(64, 1024, 10000.0, None)
    others = [RotaryEmbedding(64, 1024, 500000.0, None), RotaryEmbedding(64, 512, 10000.0, None),
              RotaryEmbedding(32, 1024, 10000.0, None), RotaryEmbedding(64, 1024, 10000.0, YARN)]  # fmt: skip
    ptrs = {layer.cos.untyped_storage().data_ptr() for layer in [plain, *others]}
    assert len(ptrs) == 5
    freqs, factor = _angles(64, 1024, 10000.0, YARN)
    assert torch.equal(others[-1].cos, freqs.cos() * factor)
    with torch.device("meta"):
        assert RotaryEmbedding(64, 1024, 10000.0, None).cos.device.type == "meta"
