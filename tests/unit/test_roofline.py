"""The decode memory floor of `bench.roofline` on the shipped configs: weight bytes from the
meta-device model equal the published parameter counts, KV bytes follow each layer's window."""

from __future__ import annotations

from minisgl.bench.roofline import floor, kv_bytes_per_step, weight_bytes_per_step
from minisgl.bench.offline import build_parser
from minisgl.models.config import ModelConfig


def test_weight_bytes_match_the_published_parameter_counts() -> None:
    # google/gemma-3-1b-it: 999,885,952 parameters (tied embedding); microsoft/Phi-4-mini-instruct: 3,836,021,760.
    assert weight_bytes_per_step(ModelConfig.from_dir("configs/gemma-3-1b-it"), 2) == 2 * 999_885_952
    assert weight_bytes_per_step(ModelConfig.from_dir("configs/phi-4-mini-instruct"), 2) == 2 * 3_836_021_760


def test_kv_bytes_follow_the_windows() -> None:
    gemma = ModelConfig.from_dir("configs/gemma-3-1b-it")  # 26 layers, 4 of them global; window 512
    per_token = 2 * 1 * 256 * 2
    assert kv_bytes_per_step(gemma, 100, 2) == 26 * 100 * per_token
    assert kv_bytes_per_step(gemma, 2000, 2) == (4 * 2000 + 22 * 512) * per_token
    phi = ModelConfig.from_dir("configs/phi-4-mini-instruct")  # its 262144 window is past the context: global
    assert kv_bytes_per_step(phi, 5000, 2) == 32 * 5000 * 2 * 8 * 128 * 2


def test_floor_of_a_small_workload() -> None:
    args = build_parser().parse_args(["--model", "configs/qwen3-0.6b", "--num-seqs", "2", "--min-input", "10",
                                      "--max-input", "10", "--min-output", "3", "--max-output", "3"])  # fmt: skip
    record = floor(args, 1e12)
    config = ModelConfig.from_dir("configs/qwen3-0.6b")
    kv = 2 * (kv_bytes_per_step(config, 11, 2) + kv_bytes_per_step(config, 12, 2))
    assert record["kv_bytes"] == kv and record["decode_steps"] == 2 and record["output_tokens"] == 6
    assert record["floor_s"] == round((kv + 2 * record["weight_bytes_per_step"]) / 1e12, 3)
