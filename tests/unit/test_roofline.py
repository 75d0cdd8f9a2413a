"""The decode memory floor of `bench.roofline` on the shipped configs: weight bytes from the
meta-device model equal the published parameter counts, KV bytes follow each layer's window."""

from __future__ import annotations

from minisgl.bench.offline import build_parser
from minisgl.bench.roofline import floor, kv_bytes_per_step, weight_bytes_per_step
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


def test_moe_experts_count_per_routed_expert() -> None:
    from minisgl.bench.roofline import weight_bytes

    config = ModelConfig.from_dir("configs/qwen3-30b-a3b")  # 48 layers, 128 experts, top 8
    wb = weight_bytes(config, 2)
    one_expert = 48 * 3 * 2048 * 768 * 2  # gate, up and down of one expert in every layer
    assert (wb.num_experts, wb.top_k, wb.per_expert) == (128, 8, one_expert)
    # Qwen3-30B-A3B: 30,532,122,624 parameters in all (untied: the input embedding is not read).
    assert wb.dense + 128 * wb.per_expert == 2 * (30_532_122_624 - 151_936 * 2048)
    assert wb.per_step(1) == wb.dense + 8 * one_expert  # one token reads its top-k experts
    assert wb.dense + 127 * one_expert < wb.per_step(256) < wb.dense + 128 * one_expert
    dense = weight_bytes(ModelConfig.from_dir("configs/qwen3-8b"), 2)
    assert dense.per_expert == 0 and dense.per_step(1) == dense.per_step(256) == dense.dense


def test_the_floor_follows_the_batch_and_the_kv_dtype() -> None:
    from minisgl.bench.roofline import weight_bytes
    from minisgl.bench.workload import make_workload

    flags = ["--model", "configs/qwen3-30b-a3b", "--num-seqs", "2", "--min-input", "10", "--max-input", "10",
             "--min-output", "2", "--max-output", "4"]  # fmt: skip
    args = build_parser().parse_args(flags)
    record = floor(args, 1e12, measured_tok_s=10.0)
    _, outputs = make_workload(args)
    wb = weight_bytes(ModelConfig.from_dir("configs/qwen3-30b-a3b"), 2)
    batches = [sum(1 for n in outputs if n > t) for t in range(1, max(outputs))]
    assert record["weight_bytes"] == round(sum(wb.per_step(b) for b in batches))
    assert record["fraction_of_floor"] == round(10.0 / record["floor_tok_s"], 4)
    fp8 = floor(build_parser().parse_args([*flags, "--kv-cache-dtype", "fp8_e4m3"]), 1e12)
    assert fp8["kv_bytes"] * 2 == record["kv_bytes"]


def test_bench_offline_prints_its_floor(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from tests.tiny_models import make_tiny_model

    make_tiny_model("qwen3", tmp_path)
    cmd = [sys.executable, "-m", "minisgl.bench", "offline", "--model", str(tmp_path), "--device", "cpu",
           "--dtype", "float32", "--num-seqs", "3", "--min-input", "5", "--max-input", "9", "--min-output", "3",
           "--max-output", "5", "--max-token-id", "100", "--bandwidth", "0.01", "--quiet"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout.strip().splitlines()[-1])
    args = build_parser().parse_args(cmd[cmd.index("--model") :])
    expected = floor(args, 0.01e12, record["output_tok_s"], dtype_bytes=(4, 4))
    for key in ("kv_bytes", "weight_bytes", "floor_s", "floor_tok_s", "fraction_of_floor"):
        assert record[key] == expected[key], key
    assert "% of the floor" in run.stderr


def test_mla_reads_one_latent_per_token_and_layer() -> None:
    config = ModelConfig.from_dir("configs/deepseek-v2-lite")  # 27 layers, kv_lora_rank 512, rope 64
    assert kv_bytes_per_step(config, 100, 2) == 100 * 27 * (512 + 64) * 2
    from minisgl.bench.roofline import weight_bytes

    wb = weight_bytes(config, 2)  # 64 routed experts, top 6; the first layer is dense
    assert (wb.num_experts, wb.top_k) == (64, 6)
    assert wb.per_expert == 26 * 3 * 2048 * 1408 * 2
