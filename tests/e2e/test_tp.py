"""Tensor parallelism over gloo: three scheduler processes (SmolLM2 has 9 heads, 3 KV heads),
rank 0 relays every message so all ranks schedule identically; greedy output equals offline."""

from __future__ import annotations

import pytest

from minisgl.core import SamplingParams
from tests.e2e.service import post_json, start_server, wait_idle

pytestmark = pytest.mark.tp


def test_tp3_matches_offline(tmp_path_factory, offline):
    # Explicit pages: every rank must size its KV pool identically.
    srv = start_server(tmp_path_factory, "tp3", "--tp", "3", "--num-pages", "256")
    try:
        assert set(srv.child_pids()) == {"scheduler-0", "scheduler-1", "scheduler-2", "tokenizer", "detokenizer"}
        prompts = ["The capital of France is", "1, 2, 3, 4,"]
        refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        status, body = post_json(srv.port, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        assert [c["text"] for c in body["choices"]] == [r["text"] for r in refs]
        wait_idle(srv.port)
    finally:
        assert srv.stop() == 0
