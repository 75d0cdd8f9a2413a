"""Sampler: greedy, temperature, top-k / top-p / min-p sets, frequencies, seeded batch invariance.

Every test runs twice: on the torch path, and with the C++ CPU kernels (`cpu_kernels=`), which
take the plain temperature rows (kernels/csrc/cpu_sample.h) and leave filters and seeds to torch."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine.sampler import LogitsControls, Sampler, SamplingBatch, hashed_uniform
from minisgl.kernels import cpp_ext
from tests.cpu_build import build

CPU = torch.device("cpu")
_SAMPLER: list[Sampler] = [Sampler()]  # the sampler `sample` uses, set per test by `sampler_kind`


@pytest.fixture(autouse=True, params=["torch", "cpu_kernel"])
def sampler_kind(request: pytest.FixtureRequest) -> str:
    _SAMPLER[0] = Sampler(cpu_kernels=build(cpp_ext.load_library) if request.param == "cpu_kernel" else None)
    return str(request.param)
# A small vocabulary with known probabilities, deliberately not sorted by token id.
PROBS = torch.tensor([0.10, 0.40, 0.04, 0.15, 0.25, 0.06])
ORDER = [1, 4, 3, 0, 5, 2]  # token ids from most to least likely


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None) -> list[int]:
    steps = steps if steps is not None else [0] * len(params)
    batch = SamplingBatch.build(params, steps, logits.shape[-1], CPU)
    return _SAMPLER[0].sample(logits, batch).tolist()


def draw(params: SamplingParams, n: int, *, seeded: bool) -> list[int]:
    """`n` draws from PROBS: one batch of `n` identical rows, each with its own seed if `seeded`."""
    rows = [SamplingParams(**{**params.to_dict(), "seed": i}) for i in range(n)] if seeded else [params] * n
    logits = PROBS.log().expand(n, -1).contiguous()
    torch.manual_seed(1234)
    return sample(logits, rows)


def chi_square(tokens: list[int], expected: dict[int, float]) -> float:
    n = len(tokens)
    counts = {tok: 0 for tok in expected}
    for tok in tokens:
        counts[tok] += 1
    return sum((counts[tok] - n * p) ** 2 / (n * p) for tok, p in expected.items())


def renormalised(allowed: list[int], weights: torch.Tensor = PROBS) -> dict[int, float]:
    total = float(weights[allowed].sum())
    return {tok: float(weights[tok]) / total for tok in allowed}


# ---- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams(temperature=0)] * 16) == logits.argmax(-1).tolist()
    # Greedy rows stay argmax inside a mixed batch, seed or not.
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, seed=i if i % 3 else None) for i in range(16)]
    got = sample(logits, params)
    assert got[1::2] == logits.argmax(-1).tolist()[1::2]


def test_greedy_accepts_low_precision_logits() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert sample(logits, [SamplingParams(temperature=0)] * 4) == logits.float().argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=1, top_k=1)] * 4) == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("seed", [None, 7])
def test_top_k_1_is_greedy(seed: int | None) -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=t, top_k=1, seed=seed) for t in (0.5, 1.0, 2.0, 10.0) for _ in range(16)]
    torch.manual_seed(0)
    assert sample(logits, params) == logits.argmax(-1).tolist()


# ---- allowed sets and frequencies ------------------------------------------------------------

CASES = [
    # (params, tokens that may be sampled)
    (SamplingParams(), ORDER),
    (SamplingParams(top_k=3), ORDER[:3]),
    (SamplingParams(top_k=100), ORDER),  # more than the vocabulary: no cut
    (SamplingParams(top_p=0.6), ORDER[:2]),  # 0.40 + 0.25 reaches 0.6
    (SamplingParams(top_p=0.7), ORDER[:3]),  # 0.65 < 0.7: the third token is needed
    (SamplingParams(top_p=0.3), ORDER[:1]),  # the first token always stays
    (SamplingParams(min_p=0.5), ORDER[:2]),  # threshold 0.2
    (SamplingParams(min_p=0.3), ORDER[:3]),  # threshold 0.12
    (SamplingParams(top_k=3, top_p=0.6), ORDER[:2]),
    (SamplingParams(top_k=2, min_p=0.1), ORDER[:2]),
    (SamplingParams(top_p=0.95, min_p=0.3), ORDER[:3]),
]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("params, allowed", CASES)
def test_filters_sample_only_allowed_tokens_at_the_right_rates(
    params: SamplingParams, allowed: list[int], seeded: bool
) -> None:
    tokens = draw(params, 4000, seeded=seeded)
    assert set(tokens) == set(allowed)
    # df <= 5: the 99.9% quantile is 20.5; the draws are seeded, so this is a fixed check.
    assert chi_square(tokens, renormalised(allowed)) < 25


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(temperature: float) -> None:
    tokens = draw(SamplingParams(temperature=temperature), 4000, seeded=True)
    assert chi_square(tokens, renormalised(ORDER, PROBS ** (1 / temperature))) < 25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_unseeded_temperature_rows_draw_at_the_right_rates(temperature: float, dtype: torch.dtype) -> None:
    """The plain rows (the C++ kernel's, on that path), with greedy rows and a logit bias mixed in."""
    n = 4000
    params = [SamplingParams(temperature=temperature)] * n
    params[::10] = [SamplingParams(temperature=0)] * len(params[::10])
    params[5::10] = [SamplingParams(temperature=temperature, logit_bias={ORDER[0]: -100.0})] * len(params[5::10])
    logits = PROBS.log().expand(n, -1).contiguous().to(dtype)
    weights = logits[0].float().exp()  # bf16 rounds the log-probabilities: the rates follow the rounded ones
    batch = SamplingBatch.build(params, [0] * n, 6, CPU)
    batch.controls = LogitsControls.build(params, [0] * n, [], CPU)
    torch.manual_seed(77)
    tokens = _SAMPLER[0].sample(logits, batch).tolist()
    assert set(tokens[::10]) == {ORDER[0]}, "greedy rows take the argmax"
    assert ORDER[0] not in tokens[5::10], "the bias of -100 removes the top token"
    plain = [t for i, t in enumerate(tokens) if i % 10 not in (0, 5)]
    assert chi_square(plain, renormalised(ORDER, weights ** (1 / temperature))) < 25
    biased = tokens[5::10]
    assert chi_square(biased, renormalised(ORDER[1:], weights ** (1 / temperature))) < 25


def test_cpu_kernel_takes_the_plain_rows(sampler_kind: str) -> None:
    """On the kernel path, a plain batch is the kernel's draw at the torch generator's uniforms."""
    if sampler_kind != "cpu_kernel":
        pytest.skip("the C++ kernel path only")
    lib = _SAMPLER[0].cpu_kernels
    assert lib is not None
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(4)) * 2
    temperature = torch.linspace(0.3, 1.5, 9)
    params = [SamplingParams(temperature=float(t)) for t in temperature]
    torch.manual_seed(21)
    got = sample(logits, params)
    torch.manual_seed(21)
    assert got == lib.sample(logits, temperature, torch.rand(9)).tolist()


def test_temperature_applies_before_the_filters() -> None:
    # At temperature 0.5 the weights are p^2: 0.16, 0.0625, 0.0225, ... so min_p 0.3 keeps 2 tokens.
    tokens = draw(SamplingParams(temperature=0.5, min_p=0.3), 4000, seeded=True)
    assert set(tokens) == set(ORDER[:2])


def test_per_row_params_apply_per_row() -> None:
    rows = [
        (SamplingParams(temperature=0), ORDER[:1]),
        (SamplingParams(top_k=3), ORDER[:3]),
        (SamplingParams(top_p=0.6), ORDER[:2]),
        (SamplingParams(min_p=0.3), ORDER[:3]),
        (SamplingParams(), ORDER),
        (SamplingParams(top_k=1), ORDER[:1]),
    ]
    repeats = 2000
    params = [p for p, _ in rows] * repeats
    logits = PROBS.log().expand(len(params), -1).contiguous()
    torch.manual_seed(5)
    tokens = sample(logits, params)
    for i, (_, allowed) in enumerate(rows):
        got = tokens[i :: len(rows)]
        assert set(got) == set(allowed), f"row kind {i}"
        if len(allowed) > 1:
            assert chi_square(got, renormalised(allowed)) < 25


# ---- seeds ------------------------------------------------------------------------------------


def _other_rows(n: int, vocab: int, salt: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    gen = torch.Generator().manual_seed(salt)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.8, seed=salt),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.7, seed=salt + 1),
    ]
    return torch.randn(n, vocab, generator=gen) * 2, [kinds[(i + salt) % len(kinds)] for i in range(n)]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(seed=11), SamplingParams(seed=11, temperature=0.8, top_k=50), SamplingParams(seed=-3, top_p=0.9)],
)
def test_seeded_row_ignores_its_batch(params: SamplingParams) -> None:
    vocab = 400
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    for step in range(10):
        alone = sample(logits.unsqueeze(0), [params], [step])[0]
        for batch_size, position in [(2, 0), (5, 4), (17, 8), (33, 20)]:
            others, other_params = _other_rows(batch_size - 1, vocab, salt=batch_size + step)
            rows = torch.cat([others[:position], logits.unsqueeze(0), others[position:]])
            row_params = other_params[:position] + [params] + other_params[position:]
            steps = [step + 100 * i for i in range(batch_size)]
            steps[position] = step
            torch.manual_seed(batch_size)  # the unseeded rows draw differently each time
            assert sample(rows, row_params, steps)[position] == alone, (step, batch_size)
        assert sample(logits.unsqueeze(0), [params], [step])[0] == alone, "not repeatable across calls"


def test_seeds_and_steps_change_the_draw() -> None:
    vocab = 1000
    flat = torch.zeros(1, vocab)
    by_seed = [sample(flat, [SamplingParams(seed=s)])[0] for s in range(200)]
    by_step = [sample(flat, [SamplingParams(seed=5)], [t])[0] for t in range(200)]
    # 200 uniform draws from 1000 tokens: about 181 distinct values expected.
    assert len(set(by_seed)) > 150 and len(set(by_step)) > 150


def test_unseeded_rows_follow_the_torch_generator() -> None:
    logits = torch.zeros(50, 1000)
    params = [SamplingParams()] * 50
    torch.manual_seed(9)
    first = sample(logits, params)
    torch.manual_seed(9)
    assert sample(logits, params) == first
    assert len(set(first)) > 30


# ---- hashed_uniform --------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _splitmix64_uniform(key: int, token: int) -> float:
    """Plain-integer reference for hashed_uniform."""
    golden = 0x9E3779B97F4A7C15
    z = ((key & _M64) * golden + token + golden) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return ((z >> 40) + 0.5) / (1 << 24)


def test_hashed_uniform_matches_an_integer_reference() -> None:
    keys = [0, 1, 2, 12345, -1, -(1 << 63), (1 << 63) - 1, 11 * 1_000_003 + 4]
    got = hashed_uniform(torch.tensor(keys, dtype=torch.int64), 64)
    for i, key in enumerate(keys):
        want = torch.tensor([_splitmix64_uniform(key, tok) for tok in range(64)], dtype=torch.float32)
        assert torch.equal(got[i], want), key


def test_hashed_uniform_is_in_the_open_unit_interval_and_uniform() -> None:
    keys = torch.arange(-500, 500, dtype=torch.int64)
    u = hashed_uniform(keys, 1000)
    assert u.shape == (1000, 1000) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.002
    bins = 20
    counts = torch.bincount((u * bins).long().flatten(), minlength=bins).double()
    expected = u.numel() / bins
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 60  # df = 19: the 99.99% quantile is about 50
    # Neighbouring keys and neighbouring tokens are uncorrelated.
    centred = u - 0.5
    assert abs(float((centred[1:] * centred[:-1]).mean())) * 12 < 0.01
    assert abs(float((centred[:, 1:] * centred[:, :-1]).mean())) * 12 < 0.01
    # The smallest value is far from 0, so -log(u) never overflows the exponential race.
    assert math.isfinite(float(-u.log().max()))


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    from minisgl.engine.sampler import _greedy

    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(3, 1000, dtype=dtype)
        logits[0, [5, 700]] = 3.0
        logits[1, [999]] = 1.0
        logits[2, [0, 1, 2]] = 2.0
        assert _greedy(logits).tolist() == [5, 999, 0] == logits.argmax(dim=-1).tolist()


def test_portable_path_keeps_the_torch_sampler(sampler_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the portable path (a CPU without AVX2) plain rows stay on torch, which is faster there."""
    if sampler_kind != "cpu_kernel":
        pytest.skip("the C++ kernel path only")
    lib = _SAMPLER[0].cpu_kernels
    assert lib is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the C++ sampler ran on the portable path")

    monkeypatch.setattr(lib, "sample", refuse)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8))
    try:
        cpp_ext.set_isa("portable")
        tokens = sample(logits, [SamplingParams(temperature=0.8)] * 4)
    finally:
        cpp_ext.set_isa("auto")
    assert len(tokens) == 4 and all(0 <= t < 300 for t in tokens)
    with pytest.raises(AssertionError, match="portable path"):
        sample(logits, [SamplingParams(temperature=0.8)] * 4)  # a vector path takes the kernel again
