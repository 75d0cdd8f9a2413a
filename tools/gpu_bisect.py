"""Bisect the GPU parity failures of GPT-OSS, LongRoPE (Phi-3) and DeepSeek-V3 (bf16) on the tiny
test models: `python tools/gpu_bisect.py [--only gpt_oss,longrope,deepseek] [--quick]`.

First the reference itself: the transformers version, whether its GptOssExperts reads the config's
swiglu_limit (5.17 hard-codes 7.0) and whether its Phi-3 `generate` equals a full forward per step
past the original length (5.17 drops the cache there but feeds one token). Then one engine per
variant of the public switches (attn torch/triton, fused kernels, PDL, fold-norms, pad-eager,
graphs, overlap): the first forward's max relative logit error against transformers (fp32 CPU) and
the first greedy divergence per prompt (-: none). GPT-OSS also checks every fused SwiGLU expert
call against `swiglu_moe_ref` on its own inputs, and each decoder layer's residual stream against
transformers' hidden states (forward hooks only). DeepSeek-V3 without interleave, bf16: at the
first divergence from transformers (bf16, CUDA), each token's rank on both sides and the fp32 logit
gap between them, and whether the test's checked routing near-tie explains it.

Research tool, not product code. Findings: not in docs/performance.md (correctness, not speed);
the session notes keep them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from minisgl import LLM, SamplingParams
from minisgl.kernels.swiglu_moe_ref import swiglu_moe_ref
from tests.engine_helpers import forward_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _greedy(llm: LLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


def _release(llm: LLM | None) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _variants(quick: bool, graphs: int) -> list[tuple[str, dict[str, Any]]]:
    base: dict[str, Any] = {"attn": "triton", "cuda_graph_max_bs": graphs}
    out = [
        ("baseline (triton, fused, graphs)", base),
        ("no graphs", {**base, "cuda_graph_max_bs": 0}),
        ("attn torch, no graphs", {**base, "attn": "torch", "cuda_graph_max_bs": 0}),
        ("no fused kernels", {**base, "fused_kernels": False}),
        ("no pdl", {**base, "pdl": False}),
    ]
    if not quick:
        out += [
            ("no fold-norms", {**base, "fold_norms": False}),
            ("no pad-eager", {**base, "pad_eager": False}),
            ("no overlap", {**base, "overlap": False}),
            ("no triton gemm", {**base, "triton_gemm": False}),
            ("everything off", {"attn": "torch", "cuda_graph_max_bs": 0, "fused_kernels": False, "pdl": False,
                                "fold_norms": False, "pad_eager": False, "overlap": False}),
        ]  # fmt: skip
    return out


def _logit_error(llm: LLM, hf: torch.nn.Module, prompt: list[int]) -> float:
    ours = forward_logits(llm.engine, [prompt], all_positions=True, first_page=100)[0].float().cpu()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].float()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _bisect(name: str, path: Path, hf: torch.nn.Module, prompts: list[list[int]], expected: list[list[int]],
            new: int, variants: list[tuple[str, dict[str, Any]]], llm_args: dict[str, Any],
            probe: Callable[[LLM], None] | None = None) -> None:  # fmt: skip
    print(f"\n== {name}: prompts {[len(p) for p in prompts]}, {new} new tokens, fp32 ==")
    print(f"{'variant':34s} {'logit err (first forward, per prompt)':44s} first divergence per prompt")
    for label, variant in variants:
        llm = None
        try:
            llm = LLM(str(path), device=DEVICE, dtype="float32", **llm_args, **variant)
            errors = " ".join(f"{_logit_error(llm, hf, p[: max(1, min(len(p), 40))]):.1e}" for p in prompts)
            diffs = [_first_diff(got, exp) for got, exp in zip(_greedy(llm, prompts, new), expected)]
            print(f"{label:34s} {errors:44s} {' '.join('-' if d is None else str(d) for d in diffs)}")
            if probe is not None and label.startswith("baseline"):
                probe(llm)
        except (ValueError, RuntimeError, AssertionError) as exc:  # refused or failed: say so, go on
            print(f"{label:34s} failed: {type(exc).__name__}: {str(exc)[:160]}")
        finally:
            _release(llm)


# ---- GPT-OSS ----


def _gpt_oss_probe(hf: torch.nn.Module, prompt: list[int]) -> Callable[[LLM], None]:
    """Forward hooks on one forward of `prompt`: each fused SwiGLU expert call against the
    reference on its inputs, and each layer's residual stream against transformers'."""

    def probe(llm: LLM) -> None:
        model = llm.engine.model
        moe_errors: list[float] = []
        layer_out: list[torch.Tensor] = []

        def moe_hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            hidden, routing = args
            w13, w2 = (module.gate_up_proj, module.down_proj) if not module.mxfp4 else (None, None)
            if w13 is None:
                return
            ref = swiglu_moe_ref(hidden, w13, module.gate_up_proj_bias, w2, module.down_proj_bias, routing.weights,
                                 routing.ids, module.limit, module.alpha)  # fmt: skip
            moe_errors.append(((output - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item())

        def layer_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            hidden, residual = output
            layer_out.append((hidden + residual).float().cpu())

        hooks = [m.register_forward_hook(moe_hook) for m in model.modules() if type(m).__name__ == "SwigluExperts"]
        hooks += [layer.register_forward_hook(layer_hook) for layer in model.model.layers]
        try:
            forward_logits(llm.engine, [prompt], all_positions=True, first_page=150)
        finally:
            for hook in hooks:
                hook.remove()
        with torch.no_grad():
            states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        print(f"  probe, prompt len {len(prompt)}: fused experts vs reference, max rel error per call: "
              f"{' '.join(f'{e:.1e}' for e in moe_errors) or '(none ran)'}")  # fmt: skip
        for i, ours in enumerate(layer_out):
            theirs = states[i + 1][0].float()
            if i == len(layer_out) - 1:
                break  # transformers' last hidden state is after the final norm
            print(f"  layer {i}: residual stream max rel error {((ours - theirs).abs().max() / theirs.abs().max()).item():.1e}")

    return probe


def run_gpt_oss(quick: bool) -> None:
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from tests.golden.test_gpt_oss import VOCAB, make_tiny_gpt_oss
    from tests.tiny_models import hf_greedy

    config = tf.GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=4, swiglu_limit=1.5)
    limit = GptOssExperts(config).limit
    print(f"\ntransformers {transformers.__version__}: GptOssExperts(swiglu_limit=1.5).limit = {limit}"
          f"{'  <- ignores the config: an HF reference built from it clamps at 7.0' if limit != 1.5 else ''}")  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="bisect_gpt_oss_"))
    hf = make_tiny_gpt_oss(path)  # sets the reference's limit from the config (tests/golden/test_gpt_oss.py)
    rng = random.Random(26)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 40, 130)]
    new = 16 if quick else 48
    expected = [hf_greedy(hf, p, new) for p in prompts]
    args = {"page_size": 16, "num_pages": 256, "max_prefill_tokens": 64}
    _bisect("GPT-OSS", path, hf, prompts, expected, new, _variants(quick, 16), args, _gpt_oss_probe(hf, prompts[1]))


# ---- LongRoPE ----


def run_longrope(quick: bool) -> None:
    from tests.golden.test_longrope import NEW_TOKENS, _make_phi3, _prompts, hf_greedy
    from tests.tiny_models import hf_greedy as generate_greedy

    for partial in (1.0,) if quick else (1.0, 0.5):
        path = Path(tempfile.mkdtemp(prefix="bisect_phi3_"))
        hf = _make_phi3(path, partial)
        prompts = _prompts(8, (5, 16, 17, 40))
        expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        generated = [_first_diff(generate_greedy(hf, p, NEW_TOKENS), e) for p, e in zip(prompts, expected)]
        print(f"\ntransformers {transformers.__version__}: Phi-3 generate vs a full forward per step, first divergence "
              f"per prompt: {' '.join('-' if d is None else str(d) for d in generated)}"
              f"{'  <- generate is no reference past the original length' if any(d is not None for d in generated) else ''}")  # fmt: skip
        args = {"page_size": 16, "num_pages": 256, "max_prefill_tokens": 8}
        _bisect(f"LongRoPE, partial rotary {partial}", path, hf, prompts, expected, NEW_TOKENS, _variants(quick, 8), args)


# ---- DeepSeek-V3 bf16 ----


def run_deepseek(quick: bool) -> None:
    from tests.deepseek_models import VOCAB, make_tiny_deepseek

    path = Path(tempfile.mkdtemp(prefix="bisect_dsv3_"))
    hf = make_tiny_deepseek("v3_no_interleave", path)
    hf16 = copy.deepcopy(hf).to(DEVICE, torch.bfloat16)
    rng = random.Random(26)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 40, 130)]
    print("\n== DeepSeek-V3 (no interleave), bf16: first divergence from transformers bf16 ==")
    llm = LLM(str(path), device=DEVICE, dtype="bfloat16", attn="triton", page_size=16, num_pages=256)
    try:
        for prompt in prompts:
            ours = _greedy(llm, [prompt], 48)[0]
            with torch.no_grad():
                out = hf16.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=48, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)  # fmt: skip
            theirs = out[0, len(prompt) :].tolist()
            i = _first_diff(ours, theirs)
            if i is None:
                print(f"prompt len {len(prompt)}: equal for 48 tokens")
                continue
            a, b, context = ours[i], theirs[i], prompt + ours[:i]
            with torch.no_grad():
                l16 = hf16(torch.tensor([context], device=DEVICE)).logits[0, -1].float().cpu()
                l32 = hf(torch.tensor([context])).logits[0, -1].float()
            lo = forward_logits(llm.engine, [context], first_page=200)[0][0].float().cpu()

            def rank(logits: torch.Tensor, token: int) -> int:
                return int((logits > logits[token]).sum())

            print(f"prompt len {len(prompt)}: divergence at {i}: ours {a} (rank {rank(l16, a)} in HF bf16, "
                  f"{rank(l32, a)} in fp32), HF {b} (rank {rank(lo, b)} in ours, {rank(l32, b)} in fp32); "
                  f"fp32 logit gap {(l32[b] - l32[a]).item():+.3e} on max |logit| {l32.abs().max().item():.2f}; "
                  f"max |ours - fp32| {(lo - l32).abs().max().item():.3f}, max |HF bf16 - fp32| "
                  f"{(l16 - l32).abs().max().item():.3f}")  # fmt: skip
            if torch.cuda.is_available():  # the test module skips itself without CUDA
                from tests.golden.test_gpu_parity_deepseek import routing_near_tie

                print(f"  checked routing near-tie: {routing_near_tie(llm, context, b) or 'yes'}")
    finally:
        _release(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="gpt_oss,longrope,deepseek", help="comma-separated: gpt_oss,longrope,deepseek")
    parser.add_argument("--quick", action="store_true", help="fewer variants and tokens")
    args = parser.parse_args()
    print(f"device {DEVICE}, torch {torch.__version__}, transformers {transformers.__version__}")
    runs = {"gpt_oss": run_gpt_oss, "longrope": run_longrope, "deepseek": run_deepseek}
    for name in args.only.split(","):
        runs[name.strip()](args.quick)


if __name__ == "__main__":
    main()
