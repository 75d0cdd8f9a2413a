"""DeepSeek-V2/V3 under tensor parallelism over gloo (offline, 2 ranks): heads split (q_proj /
q_b_proj, kv_b_proj by head, o_proj by input), the latent cache and the low-rank
down-projections replicated, experts and the shared/dense MLPs split along their intermediate
dimension. Greedy token ids equal TP=1 token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import LLM
from tests.deepseek_models import make_tiny_deepseek
from tests.golden.test_tp_parity import NEW_TOKENS, _engine_config, _greedy, _run_tp

pytestmark = pytest.mark.tp


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_tp2_greedy_equals_tp1(tmp_path: Path, variant: str) -> None:
    make_tiny_deepseek(variant, tmp_path)
    reference = LLM(engine_config=_engine_config(str(tmp_path)))
    expected = _greedy(reference)
    full_params = sum(p.numel() for p in reference.engine.model.parameters())
    assert all(len(ids) == NEW_TOKENS for ids in expected)
    got = _run_tp(tmp_path, 2)
    for rank, (ids, params) in sorted(got.items()):
        assert ids == expected, f"DeepSeek {variant} TP=2: rank {rank} decoded differently from TP=1"
        # Each rank holds its shard; the replicated latent path and router are a small remainder.
        assert params < full_params * 0.75, f"rank {rank} holds {params} of {full_params} parameters"
