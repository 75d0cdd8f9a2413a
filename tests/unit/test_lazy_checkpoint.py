"""Tensor-parallel ranks read only their shard of each checkpoint tensor (LazyTensor), and the
shard equals the same slice of the fully read tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp_rank_reads_only_its_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Rank 1 of 2 loads a tiny checkpoint: only replicated tensors (norms, the MoE router) are
    read whole, and every sharded parameter equals the matching slice of the TP=1 model's."""
    from minisgl.distributed import TPInfo, get_tp_info, set_tp_info
    from minisgl.models.config import ModelConfig
    from minisgl.models.loader import load_weights
    from minisgl.models.registry import build_model

    if arch == "qwen3_moe":
        from tests.golden.test_moe_parity import make_tiny_moe

        make_tiny_moe(tmp_path)
    else:
        from tests.tiny_models import make_tiny_model

        make_tiny_model(arch, tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    whole: list[str] = []
    materialize = LazyTensor.materialize

    def spy(self: LazyTensor) -> torch.Tensor:
        whole.append(self.name)
        return materialize(self)

    monkeypatch.setattr(LazyTensor, "materialize", spy)
    saved = get_tp_info()
    try:
        set_tp_info(TPInfo(0, 1))
        full = build_model(config)
        load_weights(full, tmp_path, show_progress=False)
        set_tp_info(TPInfo(1, 2))
        shard = build_model(config)
        load_weights(shard, tmp_path, show_progress=False)
    finally:
        set_tp_info(saved)
    assert whole, "the replicated norms are read whole"
    assert all("norm" in name or name.endswith("mlp.gate.weight") for name in whole), whole
    full_params = dict(full.named_parameters())
    for name, param in shard.named_parameters():
        ref = full_params[name]
        if param.shape == ref.shape:
            assert torch.equal(param, ref), name
            continue
        # A shard: rank 1's half along the one dimension that differs, per fused part.
        dim = next(d for d in range(ref.dim()) if ref.shape[d] != param.shape[d])
        parts = 2 if name.endswith(("gate_up_proj.weight", "experts.gate_up_proj.weight")) else 1
        if name.endswith("qkv_proj.weight"):
            continue  # q/k/v parts of different sizes: covered by the TP parity tests
        ref_parts = ref.chunk(parts, dim)
        got_parts = param.chunk(parts, dim)
        for r, g in zip(ref_parts, got_parts):
            assert torch.equal(g, r.narrow(dim, r.shape[dim] // 2, r.shape[dim] // 2)), name
