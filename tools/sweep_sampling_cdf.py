"""Temperature sampling by the inverse CDF in two passes, against the Gumbel-max kernel.

`kernels/sampling.py` draws with Gumbel-max: per logit a hash, two `lg2` and a compare, ~40
instructions, which makes it compute-bound (31 us at 170 rows of Qwen3's vocabulary on an H200,
where reading the logits takes ~11). This draws from the same distribution with one `ex2` per logit:
- pass 1, one program per (row, split of the vocabulary): the split's max m and its mass
  sum(2^(x / T - m)) (x in log2 units), in one read: each lane keeps its own running max and a sum
  relative to it, so only one exponential is taken per logit;
- pass 2, one program per row: the splits' masses on a common scale, one uniform per row (the
  same hash), the split where the cumulative mass crosses it, then that split alone read again to
  find the token.
Greedy rows (T == 0) keep the plain argmax (first index on ties).

GPU: `python tools/sweep_sampling_cdf.py` prints us per call for both at the workload's shapes
and checks that both follow softmax(x / T) on a small vocabulary. On the H200 (BENCHMARKS.md,
ninth session) it did not pay: 31.5 vs 31.2 us at 170 rows, 17.1 vs 14.2 at 64, so the engine keeps
Gumbel-max. Without CUDA: the same checks
under the Triton interpreter.

Research tool, not product code. Findings: docs/performance.md, "Tried and lost" (a two-pass
inverse-CDF sampler).
"""

from __future__ import annotations

import torch

if not torch.cuda.is_available():
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minisgl.kernels.sampling import gumbel_sample, hash_uniform  # noqa: E402

VOCAB = 151_936
_LOG2E = 1.4426950408889634


@triton.jit
def _cdf_mass_kernel(logits_ptr, temp_ptr, max_ptr, mass_ptr, idx_ptr, stride_row, vocab, num_splits,
                     SPLIT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Per (row, split): sampled rows store the split's max m (log2 units) and its mass relative to
    m; greedy rows store the split's max and the first index holding it."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temp_ptr + row)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride_row
    out = row * num_splits + split
    if temperature > 0:
        inv_t = 1.4426950408889634 / temperature
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(split * SPLIT, tl.minimum(split * SPLIT + SPLIT, vocab), BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
            hi = tl.maximum(m, x)
            # 2^(lower - higher): the new term's weight, or the old sum's rescale when x is the new max
            e = tl.exp2(tl.minimum(m, x) - tl.where(hi == float("-inf"), 0.0, hi))
            s = tl.where(x > m, s * e + 1.0, s + e)
            m = hi
        top = tl.max(m, axis=0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
        tl.store(max_ptr + out, top)
        tl.store(mass_ptr + out, tl.sum(s * scale, axis=0))
    else:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(split * SPLIT, tl.minimum(split * SPLIT + SPLIT, vocab), BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            best_idx = tl.where(better, offs, best_idx)
        top = tl.max(best, axis=0)
        tl.store(max_ptr + out, top)
        tl.store(idx_ptr + out, tl.min(tl.where(best == top, best_idx, 2147483647), axis=0))


@triton.jit(do_not_specialize=["seed"])
def _cdf_pick_kernel(logits_ptr, temp_ptr, max_ptr, mass_ptr, idx_ptr, tokens_ptr, stride_row, vocab, num_splits,
                     seed, SPLIT: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    temperature = tl.load(temp_ptr + row)
    offs_s = tl.arange(0, SPLITS)
    s_mask = offs_s < num_splits
    maxes = tl.load(max_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(maxes, axis=0)
    if temperature > 0:
        inv_t = 1.4426950408889634 / temperature
        mass = tl.load(mass_ptr + row * num_splits + offs_s, mask=s_mask, other=0.0)
        mass = mass * tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - top))
        # One uniform per row from the same hash as the Gumbel kernel's noise, u in (0, 1).
        u = hash_uniform(row.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32) * 0x85EBCA77)
        target = u * tl.sum(mass, axis=0)
        below = tl.cumsum(mass, axis=0) <= target
        # The split where the cumulative mass passes the target (the last one with mass if rounding
        # leaves the target past the total), and what is left of the target inside it.
        last = tl.max(tl.where(mass > 0, offs_s, 0), axis=0)
        chosen = tl.minimum(tl.sum(below.to(tl.int32), axis=0), last)
        rest = target - tl.sum(tl.where(offs_s < chosen, mass, 0.0), axis=0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        acc = 0.0
        count = 0
        last_pos = -1
        for start in range(chosen * SPLIT, tl.minimum(chosen * SPLIT + SPLIT, vocab), BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
            w = tl.exp2(x - top)  # top is finite: a sampled row has mass
            cum = acc + tl.cumsum(w, axis=0)
            count += tl.sum((cum <= rest).to(tl.int32), axis=0)
            acc += tl.sum(w, axis=0)
            last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0, offs, -1), axis=0))
        token = tl.minimum(chosen * SPLIT + count, last_pos)
    else:
        first = tl.min(tl.where((maxes == top) & s_mask, offs_s, SPLITS), axis=0)
        token = tl.load(idx_ptr + row * num_splits + first)
    tl.store(tokens_ptr + row, token.to(tl.int64))


def cdf_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int, split: int = 8192, block: int = 1024,
               num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """logits [R, V], temperature [R] float32 (0: greedy) -> token ids [R] int64."""
    rows, vocab = logits.shape
    block = min(block, triton.next_power_of_2(vocab))
    split = max(block, split // block * block)
    num_splits = triton.cdiv(vocab, split)
    dev = logits.device
    maxes = torch.empty(rows, num_splits, device=dev)
    mass = torch.empty(rows, num_splits, device=dev)
    idx = torch.empty(rows, num_splits, device=dev, dtype=torch.int32)
    tokens = torch.empty(rows, device=dev, dtype=torch.int64)
    temperature = temperature.float()
    _cdf_mass_kernel[(rows, num_splits)](logits, temperature, maxes, mass, idx, logits.stride(0), vocab, num_splits,
                                         SPLIT=split, BLOCK=block, num_warps=num_warps)  # fmt: skip
    _cdf_pick_kernel[(rows,)](logits, temperature, maxes, mass, idx, tokens, logits.stride(0), vocab, num_splits,
                              seed & 0x7FFFFFFF, SPLIT=split, BLOCK=block,
                              SPLITS=triton.next_power_of_2(num_splits), num_warps=num_warps)  # fmt: skip
    return tokens


def check(sample, rows: int, dev: torch.device) -> None:
    """Frequencies follow softmax(x / T) on a 6-token row, and on a 20,000-token row whose mass sits
    in three splits (tokens 100, 9000 and 17000); greedy rows give the first maximum."""
    for vocab, hot in ((6, [0, 1, 5, 2]), (20000, [100, 9000, 17000, 8191])):
        row = torch.full((vocab,), float("-inf"))
        row[hot] = torch.tensor([1.0, 0.5, 2.0, -0.5])
        logits = row.expand(rows, vocab).contiguous().to(dev)
        out = sample(logits, torch.full((rows,), 0.7, device=dev), 11)
        freq = torch.bincount(out.cpu(), minlength=vocab).double() / rows
        expected = torch.softmax(row.double() / 0.7, dim=0)
        bound = 4.5 * (0.25 / rows) ** 0.5
        assert (freq - expected).abs().max().item() < bound, (vocab, freq[hot], expected[hot])
        ties = logits[:2].clone()
        ties[:, hot[1]] = 2.0  # ties with hot[2]: the lower index wins
        assert sample(ties, torch.zeros(2, device=dev), 3).tolist() == [min(hot[1], hot[2])] * 2


def main() -> None:
    from sweep_decode_attention import bench  # same directory: graph-replayed, us per call

    dev = torch.device("cuda")
    check(cdf_sample, 20000, dev)
    check(gumbel_sample, 20000, dev)
    print("both follow softmax on the check rows")
    print(f"{'rows':>5} {'gumbel us':>10} {'cdf us':>8} {'cdf (split 16k) us':>19}")
    for rows in (256, 170, 64, 16):
        logits = torch.randn(rows, VOCAB, device=dev).bfloat16()
        temperature = torch.full((rows,), 0.6, device=dev)
        gumbel = bench(lambda: gumbel_sample(logits, temperature, 7))
        cdf = bench(lambda: cdf_sample(logits, temperature, 7))
        cdf16 = bench(lambda: cdf_sample(logits, temperature, 7, split=16384))
        print(f"{rows:>5} {gumbel:>10.1f} {cdf:>8.1f} {cdf16:>19.1f}")


if __name__ == "__main__":
    if torch.cuda.is_available():
        main()
    else:
        check(cdf_sample, 400, torch.device("cpu"))
        print("cpu self-check passed")
