"""Does running a decode batch as two half-batches on two streams pay? `python
scripts/probe_two_batch.py [MODEL]` (default configs/qwen3-0.6b, dummy weights, CUDA).

For each batch size and range of context lengths, replays the decode graph captured three ways,
one after another on the same engine: one batch, two half-batches whose attention kernels take
turns (the engine's two-batch mode), and two half-batches left unordered. Prints ms per replayed
step (wall time over back-to-back steps, so GPU-bound) and the speed-up over one batch.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from minisgl import LLM
from minisgl.attention.batch import ForwardBatch
from minisgl.engine.graph import GraphRunner

MODEL = sys.argv[1] if len(sys.argv) > 1 else "configs/qwen3-0.6b"
SIZES = (32, 64, 96, 128, 176, 256)
LENGTHS = ((100, 600), (400, 1500), (800, 2000))
STEPS = 30


def decode_batch(engine, n: int, lo: int, hi: int, seed: int) -> ForwardBatch:
    """n requests in rows 0..n-1, each on contiguous KV slots, lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(n)]
    table = engine.token_table
    base, out_loc = 0, []
    for row, length in enumerate(lens):
        table[row, :length] = torch.arange(base, base + length, dtype=table.dtype, device=table.device)
        out_loc.append(base + length - 1)
        base += length + 64
    dev = engine.device
    return ForwardBatch(
        phase="decode",
        input_ids=torch.randint(0, 10000, (n,), device=dev),
        positions=torch.tensor([length - 1 for length in lens], device=dev),
        out_loc=torch.tensor(out_loc, device=dev),
        rows=torch.arange(n, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        extend_lens=torch.ones(n, dtype=torch.int32, device=dev),
        extend_starts=torch.arange(n, dtype=torch.int32, device=dev),
        token_table=table,
        seq_lens_cpu=lens,
        extend_lens_cpu=[1] * n,
        sample_idx=torch.arange(n, device=dev),
    )


def step_ms(runner: GraphRunner, batch: ForwardBatch) -> float:
    for _ in range(3):
        runner.run(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        runner.run(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS * 1e3


def main() -> None:
    llm = LLM(MODEL, dummy_weights=True, max_running_requests=256, cuda_graph_max_bs=256)
    engine = llm.engine
    modes = {"one batch": dict(two_batch_min_bs=0), "two, alternating": dict(two_batch_min_bs=2),
             "two, unordered": dict(two_batch_min_bs=2, alternate=False)}  # fmt: skip
    results: dict[str, dict[tuple[int, int, int], float]] = {}
    logits: dict[str, torch.Tensor] = {}
    for mode, kwargs in modes.items():
        engine.runner = None
        torch.cuda.empty_cache()
        runner = GraphRunner(engine.model, engine.attn_backend, engine.token_table, 256, engine.scratch_row,
                             engine.pool.scratch_slot, engine.device, **kwargs)  # fmt: skip
        results[mode] = {}
        for lo, hi in LENGTHS:
            for n in SIZES:
                batch = decode_batch(engine, n, lo, hi, seed=n)
                results[mode][(n, lo, hi)] = step_ms(runner, batch)
                if (n, lo, hi) == (256, 400, 1500):
                    logits[mode] = runner.run(batch).float().clone()
        del runner
    print(f"{'batch':>5} {'lengths':>10} | " + " | ".join(f"{m:>16}" for m in modes) + " | speed-up (alternating)")
    for lo, hi in LENGTHS:
        for n in SIZES:
            row = [results[m][(n, lo, hi)] for m in modes]
            print(f"{n:>5} {f'{lo}-{hi}':>10} | " + " | ".join(f"{v:13.3f} ms" for v in row) + f" | x{row[0] / row[1]:.3f}")
    ref = logits["one batch"]
    for mode in list(modes)[1:]:
        same = (logits[mode].argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{mode}: max |logit diff| vs one batch {(logits[mode] - ref).abs().max().item():.4f}, argmax equal {same:.3f}")


if __name__ == "__main__":
    main()
