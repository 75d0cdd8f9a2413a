"""4-bit weights on a real model: the embedded SmolLM2-135M-Instruct quantized into a GPTQ
checkpoint (int4, group 128, asymmetric; the last of the 576-input layers' groups is 64 wide) by
round-to-nearest with min-max group scales (tests/w4_builders.py), served by the engine with its
layers packed (fp32 activations), against the fp32 model: issue 25's bar is the perplexity on
tests/data/kjv_genesis.txt (2,521 tokens) within 2 % and the chat prompts' greedy answers equal
for their first 16 tokens (as tests/golden/test_fp8_kv.py). Run with `-s` for the figures.

Measured 2026-12-01 through the packed engine (`python -m pytest -s tests/golden/test_w4_accuracy.py`,
4 min 46 s): perplexity 9.652 against 5.401 (+78.7 %), and the six
answers agree with fp32 for 6 (of 8), 1, 0, 8, 0 and 0 tokens. Plain RTN int4 does not reach the
bar on this 135M model, whose fp32 reference is itself a Q4_1 (group 32) model; the bar stays and
the two bar tests are strict xfails: they turn red the day a quantizer passes them.

Is +78.7 % the engine or the quantizer? (checked 2026-12-01, session 13, on the whole text): the
writer is GPTQ's RTN (min-max per row and 128-input group, the range widened to hold 0, zero
points rounded, fp16 scales); the fp32 model with each linear weight replaced by the same
`rtn(w).dequantize()` in plain torch gives 9.6520, the packed engine's figure to four decimals,
so the +78.7 % is RTN int4's real cost on this model. A per-group MSE clip search (range x
0.7-1.0) gives 9.6429; RTN at group 32, the reference's own Q4_1 block size, still 7.9056 (+46 %).
A GPTQ
error-feedback quantizer (tests/w4_builders.py: `gptq`, `collect_hessians`) with 8 x 160
self-sampled calibration tokens and 1 % damping measured worse (15.20): the Hessians of the
1536-input layers are rank-deficient at 1,280 tokens; it needs far more calibration text."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.models.source import resolve_model_dir
from tests.golden.test_embedded_parity import CONVERSATIONS
from tests.golden.test_fp8_kv import AGREE_TOKENS, TEXT, float32_reference, perplexity
from tests.w4_builders import write_w4_checkpoint

GROUP = 128
SYM = False


def measure(model_dir: Path) -> tuple[float, list]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    assert len(ids) >= 2000
    params = SamplingParams(temperature=0, max_tokens=AGREE_TOKENS, logprobs=3)
    answers = [o.outputs[0] for o in llm.chat(CONVERSATIONS, params, use_tqdm=False)]
    result = perplexity(llm, ids), answers
    del llm
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[float, list]]:
    src = resolve_model_dir(None)
    results = {"fp32": float32_reference()}  # the embedded model dequantized to fp32, measured once per run
    path = tmp_path_factory.mktemp("smollm2-w4-rtn")
    write_w4_checkpoint(src, path, "gptq", GROUP, SYM)
    results["rtn"] = measure(path)
    full = results["fp32"][0]
    for name, (ppl, answers) in results.items():
        agree = [_agreeing(a, b) for a, b in zip(results["fp32"][1], answers)]
        print(f"{name}: perplexity {ppl:.4f} ({(ppl / full - 1) * 100:+.2f} % vs fp32), "
              f"greedy tokens agreeing with fp32 per prompt {agree}")  # fmt: skip
    return results


def _agreeing(a, b) -> int:  # type: ignore[no-untyped-def]
    same = 0
    for x, y in zip(a.token_ids, b.token_ids):
        if x != y:
            break
        same += 1
    return same


def test_packed_rtn_model_runs_and_is_recorded(runs) -> None:
    full, rtn = runs["fp32"][0], runs["rtn"][0]
    assert 1.0 < full < 100.0
    assert full < rtn < full * 3  # int4 loses much here, but a broken load gives thousands


_BAR_NOT_MET = pytest.mark.xfail(strict=True, reason="RTN int4 group 128 on SmolLM2-135M: +78.7 % perplexity, "
                                 "answers part within 0-8 tokens (2026-12-01); issue 25 stays open on it")  # fmt: skip


@_BAR_NOT_MET
def test_perplexity_within_2_percent(runs) -> None:
    full, quant = runs["fp32"][0], runs["rtn"][0]
    assert abs(quant / full - 1) <= 0.02, (full, quant)


@_BAR_NOT_MET
def test_chat_answers_agree_16_tokens(runs) -> None:
    for i, (full, quant) in enumerate(zip(runs["fp32"][1], runs["rtn"][1])):
        assert _agreeing(full, quant) >= min(AGREE_TOKENS, len(full.token_ids)), (i, full.token_ids, quant.token_ids)
