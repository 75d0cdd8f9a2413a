"""Tensor parallelism in the served engine over gloo. Rank 0 relays every message, so all ranks
schedule identically, and greedy output equals the offline TP=1 engine:
- three ranks on the embedded SmolLM2 (9 heads, 3 KV heads: one KV head per rank);
- two ranks on a tiny random Llama, driven by the official openai client, two such services
  side by side (each launch picks its own ports and paths);
- a TP size that the heads do not divide is refused at launch, naming the sizes that work.
(The offline parity of TP=2/TP=4 on Llama and Qwen3 is in tests/golden/test_tp_parity.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from minisgl.core import SamplingParams
from tests.e2e.service import REPO, Server, post_json, start_server, wait_idle
from tests.e2e.tp_models import check_openai_answers, make_served_model, offline_answers

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
        assert [c["text"] for c in body["choices"]] == [r.outputs[0].text for r in refs]
        wait_idle(srv.port)
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_model("llama", tmp_path_factory.mktemp("tiny_llama"))


def test_tp2_services_side_by_side_answer_openai_client(tmp_path: Path, tiny_llama: Path) -> None:
    """Two --tp 2 launches at once: each picks its own rendezvous port and ipc paths."""
    expected: dict[str, Any] = offline_answers(tiny_llama)
    args = ("--model", str(tiny_llama), "--tp", "2", "--num-pages", "64")
    servers = [Server(tmp_path / f"tp2-{i}.log", *args) for i in range(2)]
    try:
        for srv in servers:
            srv.wait_ready()
        for srv in servers:
            assert set(srv.child_pids()) == {"scheduler-0", "scheduler-1", "tokenizer", "detokenizer"}
            check_openai_answers(srv.base_url, expected)
            wait_idle(srv.port)
    finally:
        codes = [srv.stop() for srv in servers]
    assert codes == [0, 0]


def test_tp_that_does_not_divide_the_heads_fails_at_launch() -> None:
    """SmolLM2 has 9 attention heads and 3 KV heads: --tp 4 is refused before any process starts."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minisgl", "--device", "cpu", "--tp", "4", "--port", "0"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[0].startswith("minisgl: error: --tp 4 cannot split this model"), lines
    assert "9 attention heads" in lines[0] and lines[0].endswith("use --tp 1 or 3")
    assert "started" not in proc.stdout + proc.stderr  # no child was spawned
    assert time.monotonic() - t0 < 60
