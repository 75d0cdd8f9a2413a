"""The offline benchmarks' workload (`bench offline`, `bench.roofline`, `bench profile`): random
token-id prompts and output lengths, uniform in their ranges, from `--seed`."""

from __future__ import annotations

import argparse
import random


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are uniform in [0, this]")


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Token-id prompts uniform in [0, --max-token-id (10000)]; input and output lengths uniform in their ranges."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.min_input, args.max_input))]
        for _ in range(args.num_seqs)
    ]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return prompts, outputs
