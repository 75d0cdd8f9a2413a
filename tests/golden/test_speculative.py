"""Speculative decoding changes nothing about greedy output (n-gram and draft proposals, under
chunked prefill, preemption and mixed batches), keeps the target's distribution when sampling
(chi-square on a tiny vocabulary), and leaks no page."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from tests.golden.test_embedded_parity import NEW_TOKENS, embedded_greedy
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Many tiny per-request attention calls: one intra-op thread is far faster for them on a
    loaded 2-core machine (the results are the same). Module scope: set before the module's
    reference fixtures run too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A different random model over the same 512-token vocabulary."""
    path = tmp_path_factory.mktemp("tiny_draft")
    make_tiny_model("qwen2", path, seed=3)
    return str(path)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts, half of them a block repeated (what n-gram lookup finds to propose)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        block = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))]
        out.append(block * rng.randrange(2, 4) if i % 2 else block + [rng.randrange(3, 512) for _ in range(60)])
    return out


def _spec(algorithm: str, draft: str | None) -> dict:
    return {"speculative_algorithm": algorithm, "speculative_draft_model": draft if algorithm == "draft" else None}


def _assert_idle_and_full(llm: LLM) -> None:
    sched = llm.scheduler
    sched.check_idle_invariants()  # every row free, pages free or cached, no draft mirror left
    sched.flush_cache()
    assert sched.allocator.num_free == sched.allocator.num_pages


def _mixed_case() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = _prompts(16)
    max_tokens = [16 + (i * 7) % 40 for i in range(len(prompts))]
    return prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.fixture(scope="module")
def alone(model_dir) -> list[list[int]]:
    """Each prompt of the mixed case run by itself without speculation: both algorithms' reference."""
    prompts, params = _mixed_case()
    roomy = LLM(model_dir, device="cpu", page_size=4, num_pages=4096, max_running_requests=1)
    return [roomy.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "deferred"])
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_greedy_equal_under_chunking_preemption_and_mixed_batches(model_dir, draft_dir, alone, algorithm, overlap):
    """`deferred`: overlap asked for (CUDA's default), so each step's outputs come back after the
    next step's launch (Scheduler._step_deferred); every plan still sees all earlier tokens."""
    prompts, params = _mixed_case()

    # As tests/golden/test_scheduler_invariance.py: too few pages (retraction), a 16-token budget
    # (chunked prompts in the same steps as decodes and verify rows), a 1-token decode reserve.
    sched = SchedulerConfig(max_running_requests=16, max_prefill_tokens=16, decode_reserve_tokens=1,
                            overlap=overlap, **_spec(algorithm, draft_dir))  # fmt: skip
    tight = LLM(model_dir, device="cpu", page_size=4, num_pages=40, scheduler_config=sched)
    assert tight.scheduler.defer_outputs is overlap and not tight.scheduler.overlap
    batched = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_retractions > 0, "the test must force preemption"
    stats = tight.scheduler.spec.stats
    assert stats.verify_steps > 0 and stats.draft_tokens > 0
    for i, (got, exp) in enumerate(zip(batched, alone)):
        assert got.outputs[0].token_ids == exp, f"prompt {i} differs"
        assert got.outputs[0].finish_reason == "length"
    _assert_idle_and_full(tight)


def test_self_draft_accepts_everything(model_dir):
    """The target as its own draft: every greedy proposal is accepted, so the draft side's KV
    follows the committed tokens exactly (a stale slot would make it propose otherwise)."""
    prompts = _prompts(4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    plain = LLM(model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, params, use_tqdm=False)
    spec = LLM(model_dir, device="cpu", page_size=4, num_pages=1024, num_speculative_tokens=3, **_spec("draft", model_dir))
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in plain]
    stats = spec.scheduler.spec.stats
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert stats.mean_accepted_len > 3.5  # 4 tokens per verify row but at the ends
    _assert_idle_and_full(spec)


def test_stop_ids_and_max_tokens_apply_to_every_committed_token(model_dir):
    """A stop token or max_tokens inside an accepted run ends the request there."""
    prompts = _prompts(4, seed=4)
    plain = LLM(model_dir, device="cpu", page_size=4, num_pages=1024)
    # The target as its draft: its proposals are accepted, so the ends fall inside accepted runs.
    spec = LLM(model_dir, device="cpu", page_size=4, num_pages=1024, **_spec("draft", model_dir))
    for prompt in prompts:
        free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
        stop = free[17]
        for sp in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
                   SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)):  # fmt: skip
            want = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
            got = spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert spec.scheduler.spec.stats.accepted_tokens > 0
    _assert_idle_and_full(spec)


EMBEDDED_PARAMS = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def embedded_plain() -> tuple[str, list[list[int]], list[list[int]]]:
    """The embedded SmolLM2 (fp32) without speculation on the golden chat prompts, run once for
    both algorithms (and shared with the HF parity test: tests/golden/test_embedded_parity.py,
    `embedded_greedy`, the same engine, prompts and EMBEDDED_PARAMS): (its directory, the prompts,
    the greedy token ids)."""
    assert (EMBEDDED_PARAMS.temperature, EMBEDDED_PARAMS.max_tokens) == (0, NEW_TOKENS)
    model_dir, _, prompts, outputs = embedded_greedy()
    return model_dir, prompts, [o.token_ids for o in outputs]


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_embedded_golden_prompts_equal(embedded_plain, algorithm):
    """The embedded SmolLM2 (fp32) on the golden chat prompts: the same token ids with speculation
    (the draft: the embedded model itself, so proposals are accepted and the path is exercised)."""
    model_dir, prompts, want = embedded_plain
    params = EMBEDDED_PARAMS
    model = model_dir if algorithm == "draft" else None
    spec = LLM(device="cpu", weights="float32", **_spec(algorithm, model))
    got = [r.outputs[0].token_ids for r in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.scheduler.spec.stats.accepted_tokens > 0
    _assert_idle_and_full(spec)


# ---------------------------------------------------------------------------- sampling
VOCAB = 4


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny_vocab")
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=64,
                            initializer_range=0.5, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(7)
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def _exact_joint(model_dir: str, prompt: list[int], steps: int, temperature: float) -> dict[tuple[int, ...], float]:
    """P(the first `steps` output tokens), from Hugging Face's logits at every prefix."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, p in joint.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
            probs = torch.softmax(logits / temperature, dim=-1).tolist()
            for token, q in enumerate(probs):
                nxt[seq + (token,)] = p * q
        joint = nxt
    return joint


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_keeps_the_target_distribution(tiny_vocab_dir, seeded):
    """Chi-square of 3-token outputs sampled with n-gram speculation against the exact joint
    distribution (64 cells, sparse ones pooled): rejection sampling must not bias it."""
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]  # n-gram lookup proposes continuations of the cycle
    steps, temperature, samples = 3, 0.9, 2000
    exact = _exact_joint(tiny_vocab_dir, prompt, steps, temperature)
    llm = LLM(tiny_vocab_dir, device="cpu", page_size=4, num_pages=4096, max_running_requests=256,
              speculative_algorithm="ngram", num_speculative_tokens=3, seed=11)  # fmt: skip
    if seeded:  # the counter-based noise of seeded requests, keyed by each row's own output index
        params = [SamplingParams(temperature=temperature, max_tokens=steps, ignore_eos=True, seed=i) for i in range(samples)]
    else:
        params = [SamplingParams(temperature=temperature, max_tokens=steps, ignore_eos=True)] * samples
    outs = llm.generate([prompt] * samples, params, use_tqdm=False)
    stats = llm.scheduler.spec.stats
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens < stats.draft_tokens  # both paths taken
    counts: dict[tuple[int, ...], int] = dict.fromkeys(itertools.product(range(VOCAB), repeat=steps), 0)
    for out in outs:
        counts[tuple(out.outputs[0].token_ids)] += 1
    # Cells expected fewer than 5 times pooled into one (the chi-square approximation needs it).
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for cell, p in exact.items():
        if p * samples >= 5:
            observed.append(counts[cell])
            expected.append(p * samples)
        else:
            rest_obs += counts[cell]
            rest_exp += p * samples
    observed.append(rest_obs)
    expected.append(rest_exp)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = len(observed) - 1
    # p < 1e-4 (Wilson-Hilferty): a biased sampler lands far beyond; a correct one almost never.
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert z < 3.72, f"chi2 {chi2:.1f} with {dof} degrees of freedom (z = {z:.2f})"
    _assert_idle_and_full(llm)
