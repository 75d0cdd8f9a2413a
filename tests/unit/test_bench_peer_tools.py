"""The CPU peer benchmark's helpers (scripts/cpu_bench.sh): `python -m minisgl.bench table` and
`python -m minisgl.bench dequant-gguf`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, quants

from minisgl.bench.__main__ import main as bench_main
from minisgl.bench.dequant_gguf import dequantize_file
from minisgl.bench.table import table
from tests.gguf_builders import write_gguf


def _result(preset: str, label: str, tok_s: list[float], errors: list[str] | None = None) -> dict[str, Any]:
    stats = {"p50": 12.4, "p99": 30.6}
    runs = [{"output_tok_s": t, "usage_source": "usage", "short_outputs": 0, "ttft_ms": stats, "itl_ms": stats,
             "tpot_ms": stats, "e2e_ms": stats, "completed": 32, "failed": 0, "errors": errors or []} for t in tok_s]  # fmt: skip
    return {"preset": preset, "label": label, "runs": runs, "median": runs[len(runs) // 2]}


def test_table_rows_by_workload_then_server_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = [_result("W2", "minisgl", [10.0, 11.0, 12.0]), _result("W1", "minisgl", [5.0]),
               _result("W2", "llama-f32", [9.0, 9.5, 8.0], errors=["HTTP 500"])]  # fmt: skip
    text = table(results)
    rows = [line for line in text.splitlines() if line.startswith("| W")]
    assert [row.split(" | ")[:2] for row in rows] == [["| W1", "minisgl"], ["| W2", "minisgl"], ["| W2", "llama-f32"]]
    assert rows[1].split(" | ")[2] == "11.0" and rows[1].endswith("10.0 / 11.0 / 12.0 |")
    assert "- W2 llama-f32: HTTP 500" in text
    path = tmp_path / "results.jsonl"
    path.write_text("[cpu-bench] a log line\n" + "".join(json.dumps(r) + "\n" for r in results))
    assert bench_main(["table", str(path)]) == 0
    assert capsys.readouterr().out.strip() == text
    assert bench_main(["table"]) == 2


def test_dequant_gguf_writes_every_tensor_as_f32(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 64)).astype(np.float32)
    coarse = rng.standard_normal((4, 64)).astype(np.float32)
    src = write_gguf(tmp_path / "src.gguf", "llama", {"llama.block_count": 1, "general.file_type": 7},
                     {"a.weight": dense, "b.weight": (quants.quantize(coarse, GGMLQuantizationType.Q8_0),
                                                     GGMLQuantizationType.Q8_0)})  # fmt: skip
    dst = tmp_path / "dst.gguf"
    assert dequantize_file(src, dst) == 1  # one tensor was quantized
    before, after = GGUFReader(src), GGUFReader(dst)
    assert after.fields["general.file_type"].contents() == int(LlamaFileType.ALL_F32)
    assert after.fields["llama.block_count"].contents() == 1
    assert after.fields["tokenizer.ggml.tokens"].contents() == before.fields["tokenizer.ggml.tokens"].contents()
    tensors = {t.name: t for t in after.tensors}
    assert {t.tensor_type for t in tensors.values()} == {GGMLQuantizationType.F32}
    np.testing.assert_array_equal(tensors["a.weight"].data.reshape(8, 64), dense)
    expected = quants.dequantize(quants.quantize(coarse, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(tensors["b.weight"].data.reshape(4, 64), expected)
    assert np.abs(expected - coarse).max() < 0.05  # Q8_0 really was lossy-but-close
    assert not dst.with_name(dst.name + ".partial").exists()
