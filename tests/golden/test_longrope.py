"""LongRoPE (Phi-3) equals Hugging Face transformers past `original_max_position_embeddings`
(fp32, CPU, tiny random weights, original length 16, context 256).

transformers picks the factor set from the sequence's length: a prompt longer than the original
length rotates every position with the long factors, and `Phi3ForCausalLM.generate` drops its
cache once the sequence grows past it, recomputing every position with the long factors (the
reference here is that computation without `generate`: see `hf_greedy`). minisgl
does the same per request (`Req.long_rope`, `layers.rotary.long_rope_rows`); such requests share
no KV through the prefix cache, while short prompts still do."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams

ORIGINAL = 16
NEW_TOKENS = 24


def _make_phi3(path: Any, partial_rotary: float = 0.5) -> torch.nn.Module:
    """Head dim 16: partial rotary 0.5 (Phi-4-mini-like, the plain-torch rotary) or 1.0
    (Phi-3-mini-128k-like, the rotary kernels)."""
    import transformers as tf

    pairs = int(16 * partial_rotary) // 2
    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(pairs)],
            "long_factor": [3.0 + 2.5 * i * i for i in range(pairs)]}  # fmt: skip
    config = tf.Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial_rotary, rope_scaling=rope, sliding_window=None, initializer_range=0.15,
        rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("phi3_longrope")
    model = _make_phi3(path)
    # 8-token prefill chunks: a long prompt's first chunk lies wholly below the original length.
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=512, max_prefill_tokens=8)
    yield model, llm
    torch.set_num_threads(threads)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward of the sequence so far (no KV cache):
    the factor set follows the sequence's length at every step, which is what `generate` computes
    from transformers 5.2x on (it recomputes once past the original length). transformers 5.17 (the
    GPU machine's) drops the cache there but still feeds only the newest token, so its `generate`
    is no reference at the crossing: the GPU test's "token 12" divergence of a 5-token prompt."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _ids(out: Any) -> list[int]:
    return list(out["token_ids"]) if isinstance(out, dict) else list(out.outputs[0].token_ids)


def _cached(out: Any) -> int:
    return int(out["cached_tokens"]) if isinstance(out, dict) else int(out.num_cached_tokens)


def test_long_factors_change_the_tokens(phi3):
    """The test model tells the factor sets apart: the long prompt's greedy tokens, and its
    logits, differ from what the short factors give (so the parity below checks the choice)."""
    model, _ = phi3
    (prompt,) = _prompts(1, (40,))
    with torch.no_grad():
        long_logits = model(torch.tensor([prompt])).logits[0, :ORIGINAL]
        short_logits = model(torch.tensor([prompt[:ORIGINAL]])).logits[0]
    assert (long_logits - short_logits).abs().max() > 1e-2


@pytest.mark.parametrize("lengths", [(5, 12), (16,), (17, 40)], ids=["short", "original", "long"])
def test_greedy_matches_hf(phi3, lengths):
    """Short prompts decode across the original length (HF recomputes them with the long
    factors there), one prompt is exactly the original length, long ones are long from the
    first token; batched together, chunked by 8 tokens."""
    model, llm = phi3
    prompts = _prompts(sum(lengths), lengths)
    outs = _greedy(llm, prompts)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        assert len(set(expected)) > NEW_TOKENS // 4, "the tiny model collapsed into repeats"
        assert _ids(out) == expected, f"prompt len {len(prompt)}"


def test_short_and_long_prompts_in_one_batch(phi3):
    model, llm = phi3
    prompts = _prompts(3, (9, 33, 16, 20))
    for prompt, out in zip(prompts, _greedy(llm, prompts)):
        assert _ids(out) == hf_greedy(model, prompt, NEW_TOKENS), f"prompt len {len(prompt)}"


@pytest.mark.parametrize(("length", "prefix_len"), [(12, 0), (40, 0), (40, 24), (40, 8)])
def test_logits_match_hf(phi3, length, prefix_len):
    """One forward's logits at every position: a short prompt, a long one, and a long one
    extending its own earlier-computed prefix (above and below the original length)."""
    from tests.engine_helpers import forward_logits

    model, llm = phi3
    (prompt,) = _prompts(length, (length,))
    ours = forward_logits(llm.engine, [prompt], prefix_lens=[prefix_len], all_positions=True)[0]
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0, prefix_len:]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"max relative logits error {rel:.2e}"


def test_prefix_cache_keeps_the_factor_sets_apart(phi3):
    """A short prompt's KV is shared with a later short prompt; a long prompt neither reads it
    nor leaves its own (long-factor) KV for a later short prompt; every answer equals HF's."""
    model, llm = phi3
    (base,) = _prompts(77, (12,))
    first, second = base, base + [7]
    _greedy(llm, [first], 2)
    (short_again,) = _greedy(llm, [second])
    assert _cached(short_again) == 12, "a short prompt reuses a short prompt's pages"
    assert _ids(short_again) == hf_greedy(model, second, NEW_TOKENS)

    long_prompt = base + _prompts(78, (20,))[0]
    (long_out,) = _greedy(llm, [long_prompt])
    assert _cached(long_out) == 0, "a long prompt must not read short-factor KV"
    assert _ids(long_out) == hf_greedy(model, long_prompt, NEW_TOKENS)

    (other,) = _prompts(79, (36,))
    _greedy(llm, [other], 2)  # long: caches nothing
    for prompt in (other[:14], other + [5]):
        (out,) = _greedy(llm, [prompt])
        assert _cached(out) == 0, f"len {len(prompt)}: KV of a long prompt must not be shared"
        assert _ids(out) == hf_greedy(model, prompt, NEW_TOKENS), f"len {len(prompt)}"


def test_triton_backend_matches_hf(phi3, tmp_path):
    """The same with the Triton attention backend (the Triton interpreter on CPU)."""
    import importlib.util

    from minisgl.kernels.attention import is_interpreted

    assert importlib.util.find_spec("triton") is not None
    if not torch.cuda.is_available() and not is_interpreted():
        pytest.skip("triton was imported in compiled mode before the interpreter could be selected")
    model, _ = phi3
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", attn="triton", page_size=4, num_pages=256, max_prefill_tokens=8)
    prompts = _prompts(5, (6, 16, 30))
    for prompt, out in zip(prompts, _greedy(llm, prompts, 16)):
        assert _ids(out) == hf_greedy(model, prompt, 16), f"prompt len {len(prompt)}"


def test_full_rotary_matches_hf(tmp_path):
    """Every head dim rotating (Phi-3-mini-128k's layout): the rotary kernels' path, not the
    partial-rotary reference."""
    model = _make_phi3(tmp_path, partial_rotary=1.0)
    llm = LLM(str(tmp_path), device="cpu", page_size=4, num_pages=256, max_prefill_tokens=8)
    assert llm.engine.model_config.rotary_dim == llm.engine.model_config.head_dim
    prompts = _prompts(6, (7, 30))
    for prompt, out in zip(prompts, _greedy(llm, prompts, 16)):
        assert _ids(out) == hf_greedy(model, prompt, 16), f"prompt len {len(prompt)}"


@pytest.mark.parametrize("partial_rotary", [0.5, 1.0])
def test_gpu_case_on_cpu(tmp_path, partial_rotary):
    """The GPU case's prompts, pages and chunks on CPU (torch backend): its 5- and 16-token
    prompts cross the original length while decoding; transformers 5.17's `generate` parts from
    the recomputed reference at tokens 12 and 1 there (see `hf_greedy`), this engine must not."""
    model = _make_phi3(tmp_path, partial_rotary)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", page_size=16, num_pages=256, max_prefill_tokens=8)
    prompts = _prompts(8, (5, 16, 17, 40))
    for prompt, out in zip(prompts, _greedy(llm, prompts)):
        assert _ids(out) == hf_greedy(model, prompt, NEW_TOKENS), f"prompt len {len(prompt)}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("partial_rotary", [0.5, 1.0])
@pytest.mark.parametrize("graph_bs", [8, 0])
def test_gpu_triton_matches_hf(tmp_path, partial_rotary, graph_bs):
    """On the GPU: the Triton backend and rotary kernels (full rotary), with and without CUDA
    graphs, fp32, prompts within, at and past the original length, decodes crossing it."""
    model = _make_phi3(tmp_path, partial_rotary)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", attn="triton", page_size=16, num_pages=256,
              cuda_graph_max_bs=graph_bs, max_prefill_tokens=8)  # fmt: skip
    prompts = _prompts(8, (5, 16, 17, 40))
    for prompt, out in zip(prompts, _greedy(llm, prompts)):
        assert _ids(out) == hf_greedy(model, prompt, NEW_TOKENS), f"prompt len {len(prompt)}"
