"""Logit controls against straightforward per-request references: repetition / frequency /
presence penalties over incrementally kept device counts, logit_bias, the min_tokens ban, the
structured-output bitmask; rows without a control are left bit for bit."""

from __future__ import annotations

import random

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.grammar import apply_token_bitmask
from minisgl.engine.penalties import PenaltyTracker
from minisgl.engine.sampler import LogitsControls, Sampler, SamplingBatch

CPU = torch.device("cpu")
VOCAB = 97


def penalised_ref(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's definition, one request, token by token."""
    out = logits.clone()
    for token in range(out.shape[0]):
        value = float(out[token])
        if token in prompt or token in output:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = output.count(token)
        value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[token] = value
    return out


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams()  # no control: must stay untouched
    return SamplingParams(
        repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
        frequency_penalty=rng.choice([0.0, -0.5, 0.8, 2.0]),
        presence_penalty=rng.choice([0.0, 1.0, -1.5]),
    )


def test_penalties_match_reference_over_steps() -> None:
    """Counts are bumped on the device from each step's sampled tokens; after every step the
    penalised logits equal the reference built from the host token lists."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    tracker = PenaltyTracker(VOCAB, CPU)
    reqs = []
    for rid in range(7):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        reqs.append(Req(rid, prompt, _random_params(rng)))
    reqs[1].sampling = SamplingParams(repetition_penalty=1.5)  # make sure each kind is present
    reqs[2].sampling = SamplingParams(frequency_penalty=1.0)
    reqs[3].sampling = SamplingParams(presence_penalty=1.0)
    for step in range(12):
        # A changing subset of the requests samples in each step, in a changing order.
        batch_reqs = [req for req in reqs if rng.random() < 0.8]
        rng.shuffle(batch_reqs)
        if not batch_reqs:
            continue
        logits = torch.randn(len(batch_reqs), VOCAB, generator=gen) * 3
        pen = tracker.prepare(batch_reqs)
        controls = LogitsControls.build([r.sampling for r in batch_reqs], [r.output_len for r in batch_reqs], (), CPU, pen)
        got = logits if controls is None else controls.apply(logits)
        for i, req in enumerate(batch_reqs):
            expected = penalised_ref(logits[i], req.prompt_ids, req.output_ids, req.sampling)
            assert torch.allclose(got[i], expected, atol=1e-6), f"step {step}, rid {req.rid}"
            if req.sampling == SamplingParams():
                assert torch.equal(got[i], logits[i])
        # Bias towards repeats so counts above one occur.
        tokens = [rng.choice(req.output_ids) if req.output_ids and rng.random() < 0.5 else rng.randrange(VOCAB)
                  for req in batch_reqs]
        if pen is not None:
            tracker.update(pen, torch.tensor(tokens))
        for req, token in zip(batch_reqs, tokens):
            req.output_ids.append(token)


def test_released_slot_starts_clean() -> None:
    tracker = PenaltyTracker(VOCAB, CPU)
    first = Req(1, [5, 6], SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0))
    pen = tracker.prepare([first])
    assert pen is not None
    tracker.update(pen, torch.tensor([9]))
    slot = tracker.slot_of[1]
    tracker.release([1])
    second = Req(2, [7], SamplingParams(repetition_penalty=2.0))
    pen = tracker.prepare([second])
    assert pen is not None and tracker.slot_of[2] == slot
    assert int(pen.counts.sum()) == 0
    assert pen.prompt_seen is not None and pen.prompt_seen[0].nonzero().flatten().tolist() == [7]


def test_tracker_grows_and_keeps_counts() -> None:
    tracker = PenaltyTracker(VOCAB, CPU)
    reqs = [Req(rid, [rid], SamplingParams(frequency_penalty=1.0)) for rid in range(3)]
    pen = tracker.prepare(reqs)
    assert pen is not None
    tracker.update(pen, torch.tensor([1, 2, 3]))
    more = reqs + [Req(rid, [rid], SamplingParams(presence_penalty=1.0)) for rid in range(3, 20)]
    pen = tracker.prepare(more)
    assert pen is not None and tracker.capacity >= 20
    assert pen.counts[:3].nonzero().tolist() == [[0, 1], [1, 2], [2, 3]]
    assert int(pen.counts[3:].sum()) == 0


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(logit_bias={3: 5.0, 10: -100.0}),
        SamplingParams(min_tokens=2, stop_token_ids=[11]),
        SamplingParams(min_tokens=2, stop_token_ids=[11], ignore_eos=True),
        SamplingParams(min_tokens=2, stop_token_ids=[11]),
    ]
    output_lens = [0, 1, 0, 2]  # row 3 has reached min_tokens
    controls = LogitsControls.build(params, output_lens, (0, 1), CPU)
    assert controls is not None
    got = controls.apply(logits)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 10] -= 100.0
    expected[1, [0, 1, 11]] = float("-inf")
    expected[2, 11] = float("-inf")  # ignore_eos: EOS is an ordinary token
    assert torch.equal(got, expected)
    assert LogitsControls.build([SamplingParams()] * 2, [0, 0], (0,), CPU) is None


def test_bias_forces_a_token_when_sampling() -> None:
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(4)) * 4
    params = [SamplingParams(temperature=1.0, logit_bias={42: 100.0}, seed=i) for i in range(32)]
    params += [SamplingParams(temperature=0.0, logit_bias={7: 100.0})] * 32
    batch = SamplingBatch.build(params, [0] * 64, VOCAB, CPU)
    batch.controls = LogitsControls.build(params, [0] * 64, (), CPU)
    tokens = Sampler().sample(logits, batch).tolist()
    assert tokens == [42] * 32 + [7] * 32


def test_bitmask_matches_bit_loop() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 70  # not a multiple of 32: the mask has spare bits
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1])
    got = apply_token_bitmask(logits, rows, bitmask)
    expected = logits.clone()
    for j, row in enumerate(rows.tolist()):
        for token in range(vocab):
            word = int(bitmask[j, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(got, expected)
    # A logits row wider than the mask (padded vocabulary): the extra tokens are disallowed.
    wide = apply_token_bitmask(torch.zeros(1, 100), torch.tensor([0]), torch.full((1, 3), -1, dtype=torch.int32))
    assert torch.isinf(wide[0, 96:]).all() and not torch.isinf(wide[0, :96]).any()


def test_grammar_that_must_end_overrides_min_tokens() -> None:
    """If the grammar allows only EOS while min_tokens bans it, EOS stays (no row without tokens)."""
    logits = torch.zeros(2, 64)
    only_eos = torch.tensor([[1 << 5, 0]], dtype=torch.int32)  # token 5 alone
    params = [SamplingParams(min_tokens=3), SamplingParams(min_tokens=3)]
    controls = LogitsControls.build(params, [0, 0], (5,), CPU, bitmask=(torch.tensor([0]), only_eos))
    assert controls is not None
    got = controls.apply(logits)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [5]
    assert torch.isneginf(got[1, 5]) and torch.isfinite(got[1]).sum() == 63
