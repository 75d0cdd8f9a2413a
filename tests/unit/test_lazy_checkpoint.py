"""Tensor-parallel ranks read only their shard of each checkpoint tensor (LazyTensor), and the
shard equals the same slice of the fully read tensor."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minisgl.models.loader import LazyTensor, iter_checkpoint


def test_lazy_slices_equal_full_slices(tmp_path: Path) -> None:
    full = torch.randn(12, 10)
    save_file({"w": full, "b": torch.arange(6.0)}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        lazy = LazyTensor(handle, "w")
        assert lazy.shape == full.shape
        assert torch.equal(lazy.narrow(0, 4, 4), full.narrow(0, 4, 4))
        assert torch.equal(lazy.narrow(1, 5, 5), full.narrow(1, 5, 5))
        assert torch.equal(lazy[2:7], full[2:7])
        assert torch.equal(lazy.materialize(), full)
    eager = dict(iter_checkpoint(tmp_path, show_progress=False))
    lazies = dict(iter_checkpoint(tmp_path, show_progress=False, lazy=True))
    assert all(isinstance(t, LazyTensor) for t in lazies.values())
    assert torch.equal(lazies["b"].materialize(), eager["b"])
