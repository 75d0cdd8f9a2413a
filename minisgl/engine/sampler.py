"""Per-request sampling in one batched pass: greedy, temperature, top-k, top-p, min-p, seeds.

Before the distribution is formed, `LogitsControls` adjust the logits of the rows that ask for it
(vLLM order): logit_bias, repetition / frequency / presence penalties, the structured-output token
bitmask, and the min_tokens ban on stop tokens. Rows without a control pay nothing.

Seeded requests draw their noise from a counter-based hash of (seed, step, token id), so a seeded
request samples the same tokens whatever else shares its batch, on CPU and GPU alike. Unseeded
requests use the device RNG.

`token_logprobs` reports logprobs of the raw model distribution (log_softmax of the logits before
any control or temperature), as vLLM does by default.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl.core import SamplingParams
from minisgl.engine.grammar import apply_token_bitmask
from minisgl.engine.penalties import PenaltyBatch, apply_penalties
from minisgl.utils.transfer import upload

if TYPE_CHECKING:
    from minisgl.kernels.cpp_ext import CpuKernels

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hashed_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R] int64 keys -> [R, vocab] uniforms in (0, 1), from splitmix64 of key * golden + token id."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    z = keys.unsqueeze(1) * _GOLDEN + idx.unsqueeze(0) + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class LogitsControls:
    """Per-row logit adjustments for one step; each part is None when no row uses it."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    penalties: PenaltyBatch | None = None
    bitmask: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, int32 [len(rows), ceil(V/32)])

    @staticmethod
    def build(
        params: list[SamplingParams],
        output_lens: list[int],
        eos_ids: Sequence[int],
        device: torch.device,
        penalties: PenaltyBatch | None = None,
        bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> "LogitsControls | None":
        """`output_lens[i]`: tokens row i has produced before the one sampled now (min_tokens)."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias.keys())
                bias_values.extend(p.logit_bias.values())
            if output_lens[i] < p.min_tokens:
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos_ids)
                ban_rows.extend([i] * len(stops))
                ban_ids.extend(stops)
        if not bias_rows and not ban_rows and penalties is None and bitmask is None:
            return None
        i64 = torch.int64
        bias = None
        if bias_rows:
            values = upload(bias_values, torch.float32, device)
            bias = (upload(bias_rows, i64, device), upload(bias_ids, i64, device), values)
        banned = (upload(ban_rows, i64, device), upload(ban_ids, i64, device)) if ban_rows else None
        return LogitsControls(bias, banned, penalties, bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, V] -> adjusted logits (a new tensor; the input is left as it is)."""
        if self.bias is not None:
            rows, ids, values = self.bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if self.penalties is not None:
            logits = apply_penalties(logits, self.penalties)
        if self.bitmask is not None:
            logits = apply_token_bitmask(logits, *self.bitmask)
        if self.banned is not None:
            banned = logits.index_put(self.banned, torch.tensor(float("-inf"), device=logits.device))
            if self.bitmask is not None:
                # A grammar that can only end here wins over min_tokens: some token must remain.
                stuck = torch.isneginf(banned).all(dim=1, keepdim=True)
                banned = torch.where(stuck, logits, banned)
            logits = banned
        return logits


@dataclass
class SamplingBatch:
    """Sampling controls of the rows being sampled, as device tensors (built once per step)."""

    all_greedy: bool
    any_greedy: bool
    temperature: torch.Tensor  # [R] float; 1.0 for greedy rows (unused there)
    greedy: torch.Tensor  # [R] bool; empty when no row is greedy
    top_k: torch.Tensor | None  # [R] int64, vocab for "off"; None if no row uses top-k
    top_p: torch.Tensor | None  # [R] float; None if no row uses top-p
    min_p: torch.Tensor | None  # [R] float; None if no row uses min-p
    seeded_rows: torch.Tensor | None  # indices of rows with a seed
    seed_keys: torch.Tensor | None  # [len(seeded_rows)] int64: seed and step mixed
    controls: LogitsControls | None = None  # logit adjustments applied before sampling

    @staticmethod
    def build(params: list[SamplingParams], steps: list[int], vocab: int, device: torch.device) -> "SamplingBatch":
        all_greedy = all(p.greedy for p in params)
        if all_greedy:
            empty = torch.empty(0, device=device)
            return SamplingBatch(True, True, empty, empty.bool(), None, None, None, None, None)
        f32, i64 = torch.float32, torch.int64
        temperature = upload([p.temperature if not p.greedy else 1.0 for p in params], f32, device)
        any_greedy = any(p.greedy for p in params)
        # Read only when some row is greedy (one upload less per step otherwise).
        if any_greedy:
            greedy = upload([p.greedy for p in params], torch.bool, device)
        else:
            greedy = torch.empty(0, dtype=torch.bool, device=device)
        top_k = None
        if any(p.top_k is not None for p in params):
            top_k = upload([min(p.top_k or vocab, vocab) for p in params], i64, device)
        top_p = upload([p.top_p for p in params], f32, device) if any(p.top_p < 1 for p in params) else None
        min_p = upload([p.min_p for p in params], f32, device) if any(p.min_p > 0 for p in params) else None
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        seeded_rows = seed_keys = None
        if seeded:
            seeded_rows = upload(seeded, i64, device)
            keys = [_signed(int(params[i].seed) * 1_000_003 + steps[i]) for i in seeded]  # type: ignore[arg-type]
            seed_keys = upload(keys, i64, device)
        return SamplingBatch(False, any_greedy, temperature, greedy, top_k, top_p, min_p, seeded_rows, seed_keys)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, first index on ties. On CPU `max(dim).indices` (same first-index
    rule) takes ~1.3 ms for 32 x 49k bf16 logits where `argmax` takes ~2.9 ms."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


class Sampler:
    """Samples a batch of rows. Plain temperature sampling (no top-k/top-p/min-p or per-request
    seed; logit controls and greedy rows may mix in) takes one fused pass over the logits where a
    kernel for it runs: with `fused` on CUDA the Triton Gumbel-max kernel (`kernels/sampling.py`),
    with `cpu_kernels` on CPU the C++ inverse-CDF kernel (`kernels/csrc/cpu_sample.h`). The rest
    runs the torch path below, which is also those kernels' reference."""

    def __init__(self, fused: bool = False, seed: int = 0, cpu_kernels: CpuKernels | None = None) -> None:
        self.fused = fused
        self.cpu_kernels = cpu_kernels
        self._rng = random.Random(seed)  # per-call noise seeds of the fused kernel

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [R, V] (any float dtype) -> next token ids [R] int64. `logits` is not modified."""
        plain = (
            not batch.all_greedy
            and batch.top_k is None
            and batch.top_p is None
            and batch.min_p is None
            and batch.seeded_rows is None
        )
        if plain and self.fused and batch.controls is None:
            from minisgl.kernels.sampling import gumbel_sample

            temperature = batch.temperature.masked_fill(batch.greedy, 0.0) if batch.any_greedy else batch.temperature
            return gumbel_sample(logits, temperature, self._rng.getrandbits(31))
        if batch.controls is not None:
            logits = batch.controls.apply(logits.float())
        if batch.all_greedy:
            return _greedy(logits)
        if plain and self._cpu_kernel_runs(logits):
            # One uniform per row, as the CPU branch below; greedy rows carry temperature 1.0 here.
            uniform = torch.rand(logits.shape[0], dtype=torch.float32)
            sampled = self.cpu_kernels.sample(logits, batch.temperature, uniform)
        else:
            sampled = self._sample_torch(logits.float(), batch)
        if not batch.any_greedy:
            return sampled
        return torch.where(batch.greedy, _greedy(logits), sampled)

    def _cpu_kernel_runs(self, logits: torch.Tensor) -> bool:
        """The C++ sampler takes CPU fp32/bf16 logits on its vector paths. Not on the portable one:
        its per-lane exp is slower than torch's vectorized softmax and cumsum (32 rows of 49k on
        one Zen 5 thread: portable 6.2 ms, torch 2.1, AVX2 0.58, AVX-512 0.25; docs/performance.md)."""
        lib = self.cpu_kernels
        return (lib is not None and logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16)
                and lib.resolve() != "portable")  # fmt: skip

    def _sample_torch(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """fp32 logits [R, V] -> tokens [R] drawn from the filtered, tempered distribution."""
        probs = torch.softmax(logits / batch.temperature.unsqueeze(1), dim=-1)
        probs = self._filter(probs, batch)
        if probs.device.type == "cpu" and batch.seeded_rows is None:
            # CPU: one uniform per row through the CDF. The exponential race below needs a random
            # number per vocabulary entry, and CPU RNG costs ~4-20 ns each (~15 ms per step for
            # 64 rows of a 49k vocab).
            cdf = probs.cumsum(dim=-1)
            u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype) * cdf[:, -1:]
            return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_()
        if batch.seeded_rows is not None and batch.seed_keys is not None:
            uniform = hashed_uniform(batch.seed_keys, probs.shape[1])
            noise[batch.seeded_rows] = -torch.log(uniform)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.min_p is not None:
            threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        if batch.top_k is None and batch.top_p is None:
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if batch.top_k is not None:
            ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
            drop |= ranks >= batch.top_k.unsqueeze(1)
        if batch.top_p is not None:
            # Keep the smallest head whose mass reaches top_p (the first token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= batch.top_p.unsqueeze(1) * sorted_probs.sum(dim=-1, keepdim=True)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


class TokenLogprobs(NamedTuple):
    """Logprobs of chosen tokens and the top alternatives, for some rows (device tensors)."""

    chosen: torch.Tensor  # [N] float32: logprob of each row's token
    top_values: torch.Tensor  # [N, K] float32, descending
    top_ids: torch.Tensor  # [N, K] int64


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_k: int) -> TokenLogprobs:
    """Raw-distribution logprobs: logits [N, V] (before any control), tokens [N] -> TokenLogprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(top_k, dim=-1)
    return TokenLogprobs(chosen, top_values, top_ids)
