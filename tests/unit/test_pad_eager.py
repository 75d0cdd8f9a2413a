"""Padded eager steps (`--pad-eager`, `EngineConfig.pad_eager`; on by default on CUDA): an eager (prefill or mixed)
step's token count and logits rows are padded to `padded_rows`, so cuBLAS sees GEMM shapes it has
run before. The padding must not change any request's output, and must really happen."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.graph import graph_batch_sizes, padded_rows
from minisgl.engine.resolve import resolve
from minisgl.kernels.impl import triton_installed
from minisgl.platform.cpu import CpuPlatform
from minisgl.scheduler.config import SchedulerConfig
from tests.tiny_models import make_tiny_model


def test_padded_rows_sizes() -> None:
    previous = 0
    for n in range(0, 70_000):
        p = padded_rows(n)
        assert p >= n and p >= previous
        if n > 1024:
            assert p <= n * (1 + 1 / 64)
        previous = p
    # Up to the graph sizes, an eager step's logits rows land on a captured batch size.
    sizes = set(graph_batch_sizes(256))
    assert all(padded_rows(n) in sizes for n in range(1, 257))
    # Few distinct shapes: a 16k-token prefill step with up to 256 decodes riding along has one.
    assert len({padded_rows(n) for n in range(16_385, 16_385 + 256)}) == 1


def test_pad_eager_default_is_the_platforms() -> None:
    cpu = CpuPlatform()
    assert resolve(EngineConfig(device="cpu"), cpu).pad_eager is False  # CUDA's default: see the GPU test
    assert resolve(EngineConfig(device="cpu", pad_eager=True), cpu).pad_eager is True


def _generate(path, attn: str, pad: bool, monkeypatch, token_counts: list | None = None,
              device: str = "cpu") -> list[dict]:  # fmt: skip
    llm = LLM(engine_config=EngineConfig(model=str(path), device=device, attn=attn, page_size=4, num_pages=256,
                                         pad_eager=pad),
              scheduler_config=SchedulerConfig(max_prefill_tokens=40))  # fmt: skip
    assert llm.engine.pad_eager is pad
    if token_counts is not None:  # record (tokens in the batch, tokens the requests extend) per step
        runner = llm.engine.runner
        run = runner.run

        def spy(batch):
            token_counts.append((batch.num_tokens, sum(batch.extend_lens_cpu), int(batch.sample_idx.numel())))
            return run(batch)

        runner.run = spy
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 23, 61, 2)]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True, seed=3),
    ]
    results = llm.generate(prompts, params, use_tqdm=False)
    llm.scheduler.check_idle_invariants()
    return results


@pytest.mark.parametrize("attn", ["torch", "triton"])
def test_padding_changes_no_output(tmp_path, attn, monkeypatch) -> None:
    if attn == "triton" and not triton_installed():
        pytest.skip("needs triton (interpreted on CPU)")
    make_tiny_model("qwen3", tmp_path)
    counts: list[tuple[int, int, int]] = []
    padded = _generate(tmp_path, attn, True, monkeypatch, counts)
    plain = _generate(tmp_path, attn, False, monkeypatch)
    # Padding happened: eager steps ran more tokens than the requests extend, on padded_rows sizes.
    eager = [(t, n, s) for t, n, s in counts if t != n or n != s]
    assert any(t > n for t, n, _ in eager)
    assert all(t == padded_rows(n) and s == padded_rows(s) for t, n, s in eager)
    for got, want in zip(padded, plain):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_lps, want_lps in ((got.outputs[0].logprobs, want.outputs[0].logprobs),
                                  (got.prompt_logprobs, want.prompt_logprobs)):  # fmt: skip
            if want_lps is not None:
                assert got_lps is not None and len(got_lps) == len(want_lps)
                for a, b in zip(got_lps, want_lps):
                    assert (a is None) == (b is None)
                    if a is not None and b is not None:  # same tokens, ranks and logprobs
                        assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
                        assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-5)


@pytest.mark.gpu
def test_padding_changes_no_output_on_gpu(tmp_path, monkeypatch) -> None:
    """The same on CUDA (Triton attention, CUDA graphs for decode), where padding is the default."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from minisgl.platform.cuda import CudaPlatform

    assert resolve(EngineConfig(device="cuda"), CudaPlatform()).pad_eager is True
    make_tiny_model("qwen3", tmp_path)
    counts: list[tuple[int, int, int]] = []
    padded = _generate(tmp_path, "triton", True, monkeypatch, counts, device="cuda")
    plain = _generate(tmp_path, "triton", False, monkeypatch, device="cuda")
    assert any(t > n for t, n, _ in counts)
    assert [r.outputs[0].token_ids for r in padded] == [r.outputs[0].token_ids for r in plain]
