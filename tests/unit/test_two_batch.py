"""Two half-batches interleaved layer by layer (`engine/graph.py: forward_halves`) compute what the
whole batch does, and issue their attention in the order the two-stream fence relies on."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.attention.batch import ForwardBatch
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.graph import EagerRunner, forward_halves
from tests.engine_helpers import forward_logits
from tests.tiny_models import make_tiny_model

LENS = (37, 5, 64, 1, 20, 9, 33)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp("tiny_qwen3_halves")
    make_tiny_model("qwen3", path)
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=512, max_running_requests=8))
    rng = random.Random(5)
    forward_logits(engine, [[rng.randrange(512) for _ in range(n)] for n in LENS])  # prefill rows 0..6
    return engine


def decode_batch(engine: Engine, rows: list[int]) -> ForwardBatch:
    """One decode step of the prefilled requests in `rows`: each request's next token on a page of
    its own past the prefill's pages."""
    ps = engine.pool.page_size
    slots = [(400 + row) * ps for row in rows]
    for row, slot in zip(rows, slots):
        engine.token_table[row, LENS[row]] = slot
    n = len(rows)
    return ForwardBatch(
        phase="decode",
        input_ids=torch.tensor([(31 * row + 7) % 512 for row in rows]),
        positions=torch.tensor([LENS[row] for row in rows]),
        out_loc=torch.tensor(slots),
        rows=torch.tensor(rows),
        seq_lens=torch.tensor([LENS[row] + 1 for row in rows], dtype=torch.int32),
        extend_lens=torch.ones(n, dtype=torch.int32),
        extend_starts=torch.arange(n, dtype=torch.int32),
        token_table=engine.token_table,
        seq_lens_cpu=[LENS[row] + 1 for row in rows],
        extend_lens_cpu=[1] * n,
        sample_idx=torch.arange(n),
    )


class RecordingFence:
    def __init__(self, log: list[tuple[str, int, int]], index: int) -> None:
        self.log, self.index = log, index

    def before(self, layer_id: int) -> None:
        self.log.append(("before", self.index, layer_id))

    def after(self, layer_id: int) -> None:
        self.log.append(("after", self.index, layer_id))


@torch.inference_mode()
def test_halves_equal_the_whole_batch_and_take_turns(engine: Engine) -> None:
    rows = list(range(len(LENS)))
    whole = EagerRunner(engine.model, engine.attn_backend).run(decode_batch(engine, rows))
    halves = (decode_batch(engine, rows[:3]), decode_batch(engine, rows[3:]))
    log: list[tuple[str, int, int]] = []
    for index, half in enumerate(halves):
        engine.attn_backend.prepare(half)
        half.fence = RecordingFence(log, index)
    logits = engine.model.compute_logits(forward_halves(engine.model, halves, None))
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), whole.argmax(-1))
    layers = engine.model_config.num_layers
    # What HalfBatchFence's waits assume: half 0's layer L is issued before half 1's layer L, and
    # half 1's layer L before half 0's layer L + 1.
    expected = [(event, index, layer) for layer in range(layers) for index in (0, 1) for event in ("before", "after")]
    assert log == expected
