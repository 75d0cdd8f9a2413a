"""Per-request sampling in one batched pass: greedy, temperature, top-k, top-p, min-p, seeds.

Seeded requests draw their noise from a counter-based hash of (seed, step, token id), so a seeded
request samples the same tokens whatever else shares its batch, on CPU and GPU alike. Unseeded
requests use the device RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams

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


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without making the host wait for queued GPU work."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    """Sampling controls of the rows being sampled, as device tensors (built once per step)."""

    all_greedy: bool
    any_greedy: bool
    temperature: torch.Tensor  # [R] float; 1.0 for greedy rows (unused there)
    greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor | None  # [R] int64, vocab for "off"; None if no row uses top-k
    top_p: torch.Tensor | None  # [R] float; None if no row uses top-p
    min_p: torch.Tensor | None  # [R] float; None if no row uses min-p
    seeded_rows: torch.Tensor | None  # indices of rows with a seed
    seed_keys: torch.Tensor | None  # [len(seeded_rows)] int64: seed and step mixed

    @staticmethod
    def build(params: list[SamplingParams], steps: list[int], vocab: int, device: torch.device) -> "SamplingBatch":
        all_greedy = all(p.greedy for p in params)
        if all_greedy:
            empty = torch.empty(0, device=device)
            return SamplingBatch(True, True, empty, empty.bool(), None, None, None, None, None)
        f32, i64 = torch.float32, torch.int64
        temperature = _upload([p.temperature if not p.greedy else 1.0 for p in params], f32, device)
        greedy = _upload([p.greedy for p in params], torch.bool, device)
        top_k = None
        if any(p.top_k is not None for p in params):
            top_k = _upload([min(p.top_k or vocab, vocab) for p in params], i64, device)
        top_p = _upload([p.top_p for p in params], f32, device) if any(p.top_p < 1 for p in params) else None
        min_p = _upload([p.min_p for p in params], f32, device) if any(p.min_p > 0 for p in params) else None
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        seeded_rows = seed_keys = None
        if seeded:
            seeded_rows = _upload(seeded, i64, device)
            keys = [_signed(int(params[i].seed) * 1_000_003 + steps[i]) for i in seeded]  # type: ignore[arg-type]
            seed_keys = _upload(keys, i64, device)
        any_greedy = any(p.greedy for p in params)
        return SamplingBatch(False, any_greedy, temperature, greedy, top_k, top_p, min_p, seeded_rows, seed_keys)


class Sampler:
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [R, V] (any float dtype) -> next token ids [R] int64."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        logits = logits.float()
        probs = torch.softmax(logits / batch.temperature.unsqueeze(1), dim=-1)
        probs = self._filter(probs, batch)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_()
        if batch.seeded_rows is not None and batch.seed_keys is not None:
            uniform = hashed_uniform(batch.seed_keys, probs.shape[1])
            noise[batch.seeded_rows] = -torch.log(uniform)
        sampled = (probs / noise).argmax(dim=-1)
        if not batch.any_greedy:
            return sampled
        return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)

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
