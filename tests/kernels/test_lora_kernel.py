"""The segmented LoRA matmul (kernels/lora.py) against its torch reference (kernels/lora_ref.py).

Without CUDA the kernel runs in Triton's interpreter on small shapes; the `gpu` cases run larger
shapes in bf16/fp16 on the device. Rows outside every segment must come out untouched.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.kernels.attention import is_interpreted  # noqa: E402
from minisgl.kernels.lora import segment_matmul  # noqa: E402
from minisgl.kernels.lora_ref import segment_matmul_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not is_interpreted(),
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _case(lens: list[int], gaps: list[int], slots: list[int], num_slots: int, n: int, k: int,
          dtype: torch.dtype, seed: int) -> tuple:  # type: ignore[type-arg]  # fmt: skip
    """Segments of `lens` tokens separated by `gaps` base tokens (which no segment covers)."""
    gen = torch.Generator().manual_seed(seed)
    starts, pos = [], 0
    for gap, length in zip(gaps, lens):
        pos += gap
        starts.append(pos)
        pos += length
    total = pos + 3
    x = torch.randn(total, k, generator=gen).to(dtype).to(DEVICE)
    weights = (torch.randn(num_slots, n, k, generator=gen) * 0.2).to(dtype).to(DEVICE)
    out = torch.randn(total, n, generator=gen).to(dtype).to(DEVICE)
    return x, weights, out, starts


def _run(lens: list[int], gaps: list[int], slots: list[int], num_slots: int, n: int, k: int,
         dtype: torch.dtype, accumulate: bool, seed: int = 0) -> None:  # fmt: skip
    x, weights, out, starts = _case(lens, gaps, slots, num_slots, n, k, dtype, seed)
    expected = segment_matmul_ref(x, weights, out.clone(), starts, lens, slots, accumulate)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    got = segment_matmul(x, weights, out.clone(), as_t(starts), as_t(lens), as_t(slots), max(lens), accumulate)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    for start, length in zip(starts, lens):
        covered[start : start + length] = True
    assert torch.equal(got[~covered.to(DEVICE)], out[~covered.to(DEVICE)]), "a row outside the segments changed"
    if not accumulate:
        assert not torch.equal(got[covered.to(DEVICE)], out[covered.to(DEVICE)])


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize(
    "lens,gaps,slots,n,k",
    [
        ([1, 1, 1], [0, 2, 0], [0, 2, 1], 24, 40),  # decode rows (shrink-like: small N)
        ([5, 17, 2], [1, 0, 4], [1, 1, 0], 70, 16),  # prefill chunks, N past one column block
        ([33], [0], [2], 16, 64),  # one segment longer than a row block
    ],
)
def test_segment_matmul_matches_reference(lens: list[int], gaps: list[int], slots: list[int], n: int, k: int,
                                          accumulate: bool) -> None:  # fmt: skip
    _run(lens, gaps, slots, 3, n, k, torch.float32, accumulate)


def test_reference_is_a_per_segment_matmul() -> None:
    """The oracle itself, against a dense product per segment (and nothing else touched)."""
    x = torch.randn(6, 8)
    weights = torch.randn(2, 4, 8)
    out = torch.zeros(6, 4)
    segment_matmul_ref(x, weights, out, [1, 4], [2, 1], [1, 0], accumulate=False)
    torch.testing.assert_close(out[1:3], x[1:3] @ weights[1].t())
    torch.testing.assert_close(out[4:5], x[4:5] @ weights[0].t())
    assert torch.equal(out[0], torch.zeros(4)) and torch.equal(out[3], torch.zeros(4)) and torch.equal(out[5], torch.zeros(4))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_segment_matmul_gpu(dtype: torch.dtype, accumulate: bool) -> None:
    lens = [1] * 40 + [300, 7, 129]
    gaps = [0, 3] * 20 + [5, 0, 11]
    slots = [i % 4 for i in range(len(lens))]
    _run(lens, gaps, slots, 4, 4096, 64, dtype, accumulate)  # expand: rank 64 -> 4096
    _run(lens, gaps, slots, 4, 3 * 16, 2048, dtype, accumulate, seed=1)  # shrink of a fused qkv


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_lora_layer_triton_path_equals_reference_path(dtype: torch.dtype) -> None:
    """A fused qkv layer's delta (shrink into the stacked parts, block-structured expand) through
    the Triton kernel equals the torch path, with base rows between adapter segments untouched."""
    from minisgl.layers.linear import QKVParallelLinear
    from minisgl.lora.layer import LoraLinear, LoraSegments, LoraStepState

    gen = torch.Generator().manual_seed(0)
    with torch.device(DEVICE):
        layer = QKVParallelLinear(32, 8, 4, 2, bias=False).to(dtype)
    outs = []
    for use_triton in (False, True):
        state = LoraStepState()
        delta = LoraLinear(layer, state, max_loras=3, max_rank=8, use_triton=use_triton)
        for slot, rank in ((0, 8), (2, 3)):
            g = torch.Generator().manual_seed(slot)
            parts = {p: (torch.randn(rank, 32, generator=g), torch.randn(32 if p == "q" else 16, rank, generator=g) * 0.1)
                     for p in ("q", "v")}  # fmt: skip
            delta.set_slot(slot, delta.host_weights("qkv", parts))
        as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
        state.segments = LoraSegments([0, 4, 9], [3, 5, 1], [2, 0, 2], as_t([0, 4, 9]), as_t([3, 5, 1]), as_t([2, 0, 2]))
        x = torch.randn(11, 32, generator=gen).to(dtype).to(DEVICE)
        out = torch.zeros(11, 64, dtype=dtype, device=DEVICE)
        delta.add_(x, out)
        outs.append(out)
        gen.manual_seed(0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)
    assert torch.equal(outs[1][3], torch.zeros(64, dtype=dtype, device=DEVICE)) and outs[1][0].abs().sum() > 0
    assert torch.equal(outs[1][:, 32:48], torch.zeros(11, 16, dtype=dtype, device=DEVICE))  # k: untrained
