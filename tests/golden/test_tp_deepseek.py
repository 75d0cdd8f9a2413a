"""DeepSeek-V2/V3 under tensor parallelism over gloo (offline, 2 ranks): heads split (q_proj /
q_b_proj, kv_b_proj by head, o_proj by input), the latent cache and the low-rank
down-projections replicated, experts and the shared/dense MLPs split along their intermediate
dimension. Greedy token ids equal TP=1 token for token. One group of 2 ranks runs both variants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM
from tests.deepseek_models import make_tiny_deepseek
from tests.golden.test_tp_parity import (
    NEW_TOKENS,
    _engine_config,
    _greedy,
    _run_tp_many,
)

pytestmark = pytest.mark.tp

VARIANTS = ["v2", "v3"]


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[int, tuple[Any, int]]]]:
    """{variant: (its directory, {rank: (ids, parameters)})} from one TP=2 group."""
    dirs = {variant: tmp_path_factory.mktemp(f"deepseek_{variant}") for variant in VARIANTS}
    for variant, path in dirs.items():
        make_tiny_deepseek(variant, path)
    got = _run_tp_many(list(dirs.values()), 2)
    return {variant: (path, got[str(path)]) for variant, path in dirs.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_greedy_equals_tp1(tp2_runs: dict[str, tuple[Path, dict[int, tuple[Any, int]]]], variant: str) -> None:
    model_dir, got = tp2_runs[variant]
    assert len(got) == 2, f"ranks {sorted({0, 1} - set(got))} never reported"
    reference = LLM(engine_config=_engine_config(str(model_dir)))
    expected = _greedy(reference)
    full_params = sum(p.numel() for p in reference.engine.model.parameters())
    assert all(len(ids) == NEW_TOKENS for ids in expected)
    for rank, (ids, params) in sorted(got.items()):
        assert ids == expected, f"DeepSeek {variant} TP=2: rank {rank} decoded differently from TP=1"
        # Each rank holds its shard; the replicated latent path and router are a small remainder.
        assert params < full_params * 0.75, f"rank {rank} holds {params} of {full_params} parameters"
