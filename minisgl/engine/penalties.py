"""Repetition / frequency / presence penalties (vLLM semantics) over per-request token counts.

`PenaltyTracker` keeps, on the device, one slot per request that uses a penalty: the count of
every token it has generated (`counts`, int32 [slots, V]) and whether a token occurs in its
prompt (`prompt_seen`, bool [slots, V]). Counts are bumped on the device from the sampled token
tensor right after sampling, so they stay exact under overlap scheduling, where the host learns a
token one step later. Slots are keyed by request id and given back when the scheduler says the
request left (`release`).

Semantics, per row, on float32 logits:
  repetition: tokens seen in prompt or output: logit / r if logit > 0 else logit * r
  frequency:  logit -= f * count(token in output)
  presence:   logit -= p * (count(token in output) > 0)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from minisgl.core import Req, SamplingParams
from minisgl.utils.transfer import upload


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


@dataclass
class PenaltyBatch:
    """The penalised rows of one step: their counts as of this step and their penalty values."""

    rows: torch.Tensor  # [P] int64, rows of the step's logits
    slots: torch.Tensor  # [P] int64, tracker slots of those rows
    counts: torch.Tensor  # [P, V] int32, output token counts before this step's token
    prompt_seen: torch.Tensor | None  # [P, V] bool; None when no row uses a repetition penalty
    repetition: torch.Tensor | None  # [P] float32
    frequency: torch.Tensor | None  # [P] float32
    presence: torch.Tensor | None  # [P] float32


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch) -> torch.Tensor:
    """float32 logits [R, V] -> a new tensor with the penalised rows adjusted."""
    rows = logits.index_select(0, batch.rows)
    counts = batch.counts
    generated = counts > 0
    if batch.repetition is not None:
        seen = generated if batch.prompt_seen is None else generated | batch.prompt_seen
        scale = torch.where(seen, batch.repetition.unsqueeze(1), torch.ones_like(rows))
        rows = torch.where(rows > 0, rows / scale, rows * scale)
    if batch.frequency is not None:
        rows = rows - batch.frequency.unsqueeze(1) * counts
    if batch.presence is not None:
        rows = rows - batch.presence.unsqueeze(1) * generated
    return logits.index_copy(0, batch.rows, rows)


class PenaltyTracker:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.slot_of: dict[int, int] = {}  # rid -> slot
        self.free_slots: list[int] = []
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)

    @property
    def capacity(self) -> int:
        return int(self.counts.shape[0])

    def release(self, rids: Iterable[int]) -> None:
        for rid in rids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free_slots.append(slot)

    def _grow(self, needed: int) -> None:
        old = self.capacity
        new = max(8, 2 * old, old + needed)
        extra = new - old
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab)])
        self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(extra, self.vocab)])
        self.free_slots.extend(range(new - 1, old - 1, -1))

    def prepare(self, reqs: list[Req]) -> PenaltyBatch | None:
        """The penalty batch of a step's sampled requests (row i = reqs[i]), or None if none uses one."""
        rows = [i for i, req in enumerate(reqs) if uses_penalties(req.sampling)]
        if not rows:
            return None
        fresh = [reqs[i] for i in rows if reqs[i].rid not in self.slot_of]
        if len(fresh) > len(self.free_slots):
            self._grow(len(fresh) - len(self.free_slots))
        if fresh:
            self._init_slots(fresh)
        params = [reqs[i].sampling for i in rows]
        slots = upload([self.slot_of[reqs[i].rid] for i in rows], torch.int64, self.device)
        f32 = torch.float32
        repetition = frequency = presence = None
        prompt_seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = upload([p.repetition_penalty for p in params], f32, self.device)
            prompt_seen = self.prompt_seen.index_select(0, slots)
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = upload([p.frequency_penalty for p in params], f32, self.device)
        if any(p.presence_penalty != 0.0 for p in params):
            presence = upload([p.presence_penalty for p in params], f32, self.device)
        return PenaltyBatch(
            rows=upload(rows, torch.int64, self.device),
            slots=slots,
            counts=self.counts.index_select(0, slots),
            prompt_seen=prompt_seen,
            repetition=repetition,
            frequency=frequency,
            presence=presence,
        )

    def _init_slots(self, reqs: list[Req]) -> None:
        """Zero new slots and fill them from the host: prompt tokens, and any output tokens
        already known (a request normally gets its slot at its first sampled token)."""
        slots: list[int] = []
        seen_slots: list[int] = []
        seen_ids: list[int] = []
        out_slots: list[int] = []
        out_ids: list[int] = []
        for req in reqs:
            slot = self.free_slots.pop()
            self.slot_of[req.rid] = slot
            slots.append(slot)
            if req.sampling.repetition_penalty != 1.0:
                seen_slots.extend([slot] * req.prompt_len)
                seen_ids.extend(req.prompt_ids)
            known = req.output_ids[: req.output_len - req.num_pending]
            out_slots.extend([slot] * len(known))
            out_ids.extend(known)
        slot_t = upload(slots, torch.int64, self.device)
        self.counts.index_fill_(0, slot_t, 0)
        self.prompt_seen.index_fill_(0, slot_t, False)
        if seen_ids:
            index = (upload(seen_slots, torch.int64, self.device), upload(seen_ids, torch.int64, self.device))
            self.prompt_seen.index_put_(index, torch.tensor(True, device=self.device))
        if out_ids:
            index = (upload(out_slots, torch.int64, self.device), upload(out_ids, torch.int64, self.device))
            self.counts.index_put_(index, torch.ones(len(out_ids), dtype=torch.int32, device=self.device), accumulate=True)

    def update(self, batch: PenaltyBatch, tokens: torch.Tensor) -> None:
        """Count this step's sampled tokens (device tensor [R]) for the penalised rows."""
        sampled = tokens.index_select(0, batch.rows)
        ones = torch.ones_like(sampled, dtype=torch.int32)
        self.counts.index_put_((batch.slots, sampled), ones, accumulate=True)
