"""`--dp`: which replica runs each request, and where its abort must go.

A request goes to the replica with the fewest outstanding tokens: the sum, over the requests the
replica was given that have not ended, of prompt length + max_tokens (the most each can still
cost; ties go to the lowest index). A replica's rank 0 reports the requests that ended
(`FinishedMsg`: finished, aborted or refused), which frees their tokens. The tokenizer routes,
because it is the one process every request and every abort passes through (the API server's and
the detokenizer's aborts alike) and it knows the prompt's length.
"""

from __future__ import annotations

from typing import NamedTuple


class _Placed(NamedTuple):
    replica: int
    cost: int


class ReplicaRouter:
    def __init__(self, num_replicas: int) -> None:
        assert num_replicas >= 1
        self.num_replicas = num_replicas
        self.outstanding = [0] * num_replicas  # tokens per replica
        self.assigned = [0] * num_replicas  # requests per replica, ever
        self._placed: dict[int, _Placed] = {}

    def assign(self, rid: int, cost: int) -> int:
        """The replica for a new request costing `cost` tokens."""
        if self.num_replicas == 1:  # nothing to choose, nothing to remember
            self.assigned[0] += 1
            return 0
        replica = min(range(self.num_replicas), key=lambda i: (self.outstanding[i], i))
        self.outstanding[replica] += cost
        self.assigned[replica] += 1
        self._placed[rid] = _Placed(replica, cost)
        return replica

    def owner(self, rid: int) -> int | None:
        """The replica holding `rid`; None when it has ended (or never reached one)."""
        if self.num_replicas == 1:
            return 0
        placed = self._placed.get(rid)
        return None if placed is None else placed.replica

    def finished(self, rids: list[int]) -> None:
        for rid in rids:
            placed = self._placed.pop(rid, None)
            if placed is not None:
                self.outstanding[placed.replica] -= placed.cost

    @property
    def live(self) -> int:
        return len(self._placed)
