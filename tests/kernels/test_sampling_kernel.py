"""The fused Gumbel-max sampling kernel: greedy rows equal torch.argmax (ties included), sampled
rows follow softmax(logits / T), seeds reproduce, and the Sampler takes the kernel only for the
cases it covers. Without CUDA the kernel runs in Triton's interpreter (conftest selects it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine.sampler import Sampler, SamplingBatch  # noqa: E402
from minisgl.kernels.sampling import _gumbel_argmax_kernel, gumbel_sample  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = [
    # Every test here runs on both: interpreted on CPU (CI), compiled in the GPU check (-m gpu).
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CUDA and type(_gumbel_argmax_kernel).__name__ != "InterpretedFunction",
        reason="triton was imported in compiled mode before the interpreter could be selected",
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_equal_argmax_with_ties(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    vocab = 20000  # more than one split and a partial last block
    logits = torch.randn(6, vocab, device=DEVICE).to(dtype)
    # Ties at the maximum: the first index must win, also across splits.
    logits[1, [17, 9000, 15000]] = 50.0
    logits[2, [12000, 19999]] = 50.0
    logits[3] = 0.0  # all equal
    logits[4, :] = float("-inf")
    logits[4, 19999] = 1.0  # only the very last token is possible
    temperature = torch.zeros(6, device=DEVICE)
    out = gumbel_sample(logits, temperature, seed=123)
    assert out.tolist() == logits.float().argmax(dim=1).tolist()
    assert out.tolist()[1:5] == [17, 12000, 0, 19999]


def test_sampled_rows_follow_softmax() -> None:
    """Many rows of one small distribution: empirical frequencies match softmax(logits / T)."""
    # The interpreter pays ~7 ms per program (one per row): fewer rows on CPU, a looser bound.
    rows, vocab, temperature = (20000 if CUDA else 800), 6, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0, 2.0], device=DEVICE).expand(rows, vocab).contiguous()
    out = gumbel_sample(logits, torch.full((rows,), temperature, device=DEVICE), seed=7)
    freq = torch.bincount(out.cpu(), minlength=vocab).double() / rows
    expected = torch.softmax(logits[0].double().cpu() / temperature, dim=0)
    # 4.5 binomial standard errors (<= 0.08 at 800 rows): never flaky, and still below what a
    # wrong temperature shifts (token 5: 0.55 at T=0.7 vs 0.45 at T=1; 0.89 at T=0.35).
    bound = 4.5 * (0.25 / rows) ** 0.5
    assert (freq - expected).abs().max().item() < bound, (freq, expected)
    # Rows with T == 0 in the same call stay greedy.
    mixed = torch.full((200,), temperature, device=DEVICE)
    mixed[::2] = 0.0
    out = gumbel_sample(logits[:200], mixed, seed=8)
    assert (out[::2] == 5).all()
    assert len(set(out[1::2].tolist())) >= 4


def test_seed_reproduces_and_varies() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 300, device=DEVICE)
    t = torch.ones(64, device=DEVICE)
    a, b, c = gumbel_sample(logits, t, 5), gumbel_sample(logits, t, 5), gumbel_sample(logits, t, 6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sampler_uses_kernel_only_for_plain_temperature() -> None:
    torch.manual_seed(2)
    vocab = 50
    logits = torch.randn(3, vocab, device=DEVICE)
    plain = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(temperature=1.2)]
    fused = Sampler(fused=True, seed=0)
    batch = SamplingBatch.build(plain, [0, 0, 0], vocab, DEVICE)
    out = fused.sample(logits, batch)
    assert out[1].item() == logits[1].argmax().item()
    # Same Sampler seed, same draws: the kernel path is reproducible run to run.
    again = Sampler(fused=True, seed=0).sample(logits, SamplingBatch.build(plain, [0, 0, 0], vocab, DEVICE))
    assert torch.equal(out, again)
    # top-p rows (and seeded rows) take the torch path: a top_p tiny enough keeps only the argmax.
    narrow = [SamplingParams(temperature=1.0, top_p=1e-6) for _ in range(3)]
    out = fused.sample(logits, SamplingBatch.build(narrow, [0, 0, 0], vocab, DEVICE))
    assert out.tolist() == logits.argmax(dim=1).tolist()
