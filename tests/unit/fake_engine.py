"""A model-free stand-in for `Engine` that checks every `StepPlan` the scheduler hands it.

It keeps its own token table (row -> position -> slot, written from `out_loc` and `table_*` in the
same order as the real engine) and a fake KV pool that records, for every slot, the token id and
position written there. Before "running" a step it checks that each request's table maps every
position it attends to (< cached_len + extend_len) to a slot in a page the request holds, and that
the slot holds exactly that request's token at that position. A prefix cache handing out the wrong
pages, a freed page overwritten while still referenced, or a stale table entry all show up here.

The next token of a request is a deterministic function of the token history read back through
its table, so a retracted and recomputed request must reproduce the same output.

Like a synchronous device, `launch` runs the step at once; with overlap scheduling the scheduler
still sees its tokens only through `result()` one step later, and inputs still pending on the host
(`StepPlan.from_prev`) are taken from the previous launch, as the real engine does on the device.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from minisgl.core import Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.step import LogprobEntry, PromptChunk, StepPlan
from minisgl.models.pooling import PoolerConfig
from minisgl.scheduler.scheduler import Scheduler

NextToken = Callable[[Sequence[int]], int]


def hashed_next_token(vocab_size: int) -> NextToken:
    """Next token = crc32 of the whole history: depends on every token and on their order."""

    def next_token(history: Sequence[int]) -> int:
        return zlib.crc32(array("q", history).tobytes()) % vocab_size

    return next_token


def expected_output(
    prompt: Sequence[int],
    sampling: SamplingParams,
    next_token: NextToken,
    eos_ids: Sequence[int],
    context_len: int,
) -> tuple[list[int], str]:
    """What a correct scheduler must produce for `prompt`: the reference for every test."""
    out: list[int] = []
    while True:
        token = next_token([*prompt, *out])
        out.append(token)
        if not sampling.ignore_eos and token in eos_ids:
            return out, "stop"
        if token in sampling.stop_token_ids:
            return out, "stop"
        if len(out) >= sampling.max_tokens or len(prompt) + len(out) >= context_len:
            return out, "length"


@dataclass(frozen=True)
class FakePool:
    page_size: int
    num_pages: int


@dataclass(frozen=True)
class FakePlatform:
    name: str = "cpu"

    def offline_prefill_tokens(self) -> int:
        return 8192


def fake_embedding(history: Sequence[int]) -> bytes:
    """An embedding request's fake vector: the token history its last token attended to, as
    float32 (so a test sees exactly what the pooled row read through its table)."""
    return array("f", [float(t) for t in history]).tobytes()


@dataclass
class FakePooled:
    """Stands in for `PooledRows`: the embedding requests of a step and their fake vectors."""

    reqs: list[Req]
    vectors: list[bytes]

    def embeddings(self) -> list[bytes]:
        return list(self.vectors)


@dataclass
class FakeLaunched:
    """Stands in for `LaunchedStep`: sampled requests and their tokens, no logprobs."""

    sampled_reqs: list[Req]
    tokens: list[int]
    pooled: FakePooled | None = None

    def result(self) -> list[int]:
        return list(self.tokens)

    def token_logprobs(self) -> list[LogprobEntry | None]:
        return [None] * len(self.sampled_reqs)

    def prompt_logprob_chunks(self) -> list[tuple[PromptChunk, list[LogprobEntry]]]:
        return []


@dataclass(frozen=True)
class FakeModelConfig:
    eos_ids: tuple[int, ...]
    vocab_size: int
    long_rope_from: int | None = None
    kv_window: int | None = None  # a window on every layer: positions behind it are not read back


@dataclass(frozen=True)
class ReqStep:
    """One request's share of a step, as the scheduler planned it."""

    rid: int
    row: int
    cached_len: int
    extend_len: int
    total_len: int
    sampled: bool

    @property
    def is_decode(self) -> bool:
        """One token left to compute: the scheduler plans it outside the prefill token budget."""
        return self.total_len - self.cached_len == 1


@dataclass
class StepRecord:
    reqs: list[ReqStep] = field(default_factory=list)

    @property
    def rids(self) -> list[int]:
        return [r.rid for r in self.reqs]

    def get(self, rid: int) -> ReqStep | None:
        return next((r for r in self.reqs if r.rid == rid), None)


class FakeEngine:
    def __init__(
        self,
        *,
        page_size: int,
        num_pages: int,
        context_len: int = 4096,
        vocab_size: int = 1000,
        eos_ids: Sequence[int] = (),
        max_running_requests: int = 256,
        next_token: NextToken | None = None,
        pooler: PoolerConfig | None = None,
    ) -> None:
        self.pool = FakePool(page_size, num_pages)
        self.pooler = pooler  # set: an embedding model (requests with `pooling` only)
        self.platform = FakePlatform()
        self.model_dir = Path("fake-model")  # no tokenizer: structured output is not faked
        self.context_len = context_len
        self.model_config = FakeModelConfig(tuple(eos_ids), vocab_size)
        self.config = EngineConfig(
            device="cpu", page_size=page_size, num_pages=num_pages, max_running_requests=max_running_requests
        )
        self.next_token = next_token or hashed_next_token(vocab_size)
        self.steps: list[StepRecord] = []
        self._table: dict[int, dict[int, int]] = {}  # row -> position -> slot
        self._row_owner: dict[int, tuple[int, int]] = {}  # row -> (id(req), arrival) of its resident
        self._kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, position) last written there

    # ------------------------------------------------------------------------------------
    def launch(self, plan: StepPlan, prev: FakeLaunched | None = None) -> FakeLaunched:
        ps = self.pool.page_size
        self._check_shape(plan)
        true_ids = self._resolve_pending(plan, prev)
        # A row taken by a new resident starts empty: everything it reads must be written for it.
        for req in plan.reqs:
            owner = (id(req), req.arrival)
            assert req.row is not None
            if self._row_owner.get(req.row) != owner:
                self._row_owner[req.row] = owner
                self._table[req.row] = {}
        # Same order as Engine.build_batch: out_loc entries first, then the extra table entries.
        cursor = 0
        for req in plan.reqs:
            ids = true_ids[id(req)]
            held = set(req.pages)
            row_table = self._table[req.row]  # type: ignore[index]
            for pos in range(req.cached_len, req.cached_len + req.extend_len):
                slot = plan.out_loc[cursor]
                cursor += 1
                page = slot // ps
                assert page in held, f"rid {req.rid}: out_loc slot {slot} (pos {pos}) is in page {page}, not its own"
                assert pos // ps < len(req.pages) and slot == req.pages[pos // ps] * ps + pos % ps, (
                    f"rid {req.rid}: out_loc slot {slot} for pos {pos} disagrees with its page list {req.pages}"
                )
                assert pos // ps >= req.shared_pages, f"rid {req.rid}: writes pos {pos} into a cache-owned page"
                row_table[pos] = slot
                self._kv[slot] = (ids[pos], pos)
        for row, pos, slot in zip(plan.table_rows, plan.table_pos, plan.table_slots, strict=True):
            self._table.setdefault(row, {})[pos] = slot
        record = StepRecord()
        sampled_reqs: list[Req] = []
        next_tokens: list[int] = []
        pooled = FakePooled([], [])
        for req in plan.reqs:
            end = req.cached_len + req.extend_len
            history = self._read_back(req, end, true_ids[id(req)])
            sampled = end == req.total_len
            assert req.row is not None
            record.reqs.append(ReqStep(req.rid, req.row, req.cached_len, req.extend_len, req.total_len, sampled))
            if sampled and req.pooling is not None:
                pooled.reqs.append(req)
                pooled.vectors.append(fake_embedding(history))
            elif sampled:
                sampled_reqs.append(req)
                next_tokens.append(self.next_token(history))
        self.steps.append(record)
        return FakeLaunched(sampled_reqs, next_tokens, pooled if pooled.reqs else None)

    def _resolve_pending(self, plan: StepPlan, prev: FakeLaunched | None) -> dict[int, list[int]]:
        """Each request's true token ids: host placeholders replaced by the previous step's samples."""
        true_ids = {id(req): req.all_ids for req in plan.reqs}
        owner_of_token: list[tuple[Req, int]] = []  # step token index -> (request, position)
        for req in plan.reqs:
            owner_of_token.extend((req, pos) for pos in range(req.cached_len, req.cached_len + req.extend_len))
        resolved: set[int] = set()
        for index, j in plan.from_prev:
            assert prev is not None, "from_prev without a step in flight"
            req, pos = owner_of_token[index]
            assert prev.sampled_reqs[j] is req, f"rid {req.rid}: from_prev reads another request's token"
            assert pos == req.total_len - 1, f"rid {req.rid}: from_prev at pos {pos}, newest is {req.total_len - 1}"
            true_ids[id(req)][pos] = prev.tokens[j]
            resolved.add(id(req))
        for req in plan.reqs:
            if req.num_pending:
                assert id(req) in resolved, f"rid {req.rid} computes a token not yet known on the host"
        return true_ids

    def _check_shape(self, plan: StepPlan) -> None:
        assert plan.reqs, "empty plan"
        assert len(plan.out_loc) == sum(req.extend_len for req in plan.reqs), "out_loc length mismatch"
        assert len(set(plan.out_loc)) == len(plan.out_loc), "one slot written twice in a step"
        rows = [req.row for req in plan.reqs]
        assert None not in rows and len(set(rows)) == len(rows), f"rows not distinct: {rows}"
        assert len({id(req) for req in plan.reqs}) == len(plan.reqs), "request planned twice"
        assert all(0 <= row < self.config.max_running_requests for row in rows), rows  # type: ignore[operator]
        for req in plan.reqs:
            assert req.extend_len > 0 and req.cached_len + req.extend_len <= req.total_len, (
                f"rid {req.rid}: cached {req.cached_len} + extend {req.extend_len} > total {req.total_len}"
            )
            assert req.cached_len + req.extend_len <= self.context_len
            live = req.pages[: req.shared_pages] + req.pages[max(req.shared_pages, req.slid_pages) :]
            assert len(set(live)) == len(live), f"rid {req.rid}: a page twice in {req.pages}"
            assert all(0 <= page < self.pool.num_pages for page in req.pages)
            window = self.model_config.kv_window
            if req.slid_pages:
                assert window is not None and req.slid_pages * self.pool.page_size <= req.cached_len - window + 1, (
                    f"rid {req.rid}: page {req.slid_pages - 1} went back to the pool inside the window"
                )
        # Only cache-owned (shared) pages may appear in two requests.
        seen: dict[int, int] = {}
        shared = {page for req in plan.reqs for page in req.pages[: req.shared_pages]}
        for req in plan.reqs:
            for page in req.pages[max(req.shared_pages, req.slid_pages) :]:
                assert page not in shared, f"rid {req.rid} owns page {page} that is also cache-owned"
                assert page not in seen, f"page {page} owned by rids {seen[page]} and {req.rid}"
                seen[page] = req.rid

    def _read_back(self, req: Req, end: int, ids: list[int]) -> list[int]:
        """The tokens the model would attend to: read through the table, checked against the request
        (with a window on every layer, from the first one the step's first query sees; the fake
        model still reads the older ones, from the request)."""
        ps = self.pool.page_size
        held = set(req.pages)
        row_table = self._table[req.row]  # type: ignore[index]
        window = self.model_config.kv_window
        first = 0 if window is None else max(req.cached_len - window + 1, 0)
        history: list[int] = list(ids[:first])
        for pos in range(first, end):
            slot = row_table.get(pos)
            assert slot is not None, f"rid {req.rid}: no table entry for pos {pos} (row {req.row})"
            assert slot // ps in held, f"rid {req.rid}: pos {pos} reads slot {slot} outside its pages {req.pages}"
            content = self._kv.get(slot)
            assert content == (ids[pos], pos), (
                f"rid {req.rid}: pos {pos} reads slot {slot} holding {content}, expected {(ids[pos], pos)}"
            )
            history.append(content[0])
        return history


def check_scheduler_state(scheduler: Scheduler) -> None:
    """Page and row ownership across the whole scheduler: call after every step."""
    alloc, cache = scheduler.allocator, scheduler.cache
    cache.check_invariants()
    owned: dict[int, int] = {}
    rows = [req.row for req in scheduler.running]
    assert None not in rows and len(set(rows)) == len(rows), rows
    assert len(rows) + len(scheduler.free_rows) == scheduler.max_running
    assert set(rows).isdisjoint(scheduler.free_rows)
    for req in scheduler.running:
        assert not req.finished and scheduler.reqs.get(req.rid) is req
        assert req.extend_len == 0 and req.cache_handle is not None
        assert req.cached_len <= len(req.pages) * scheduler.page_size
        own_from = max(req.shared_pages, req.slid_pages)  # pages between went back to the pool
        for page in req.pages[: req.shared_pages] + req.pages[own_from:]:
            assert not alloc.is_free(page), f"rid {req.rid} holds free page {page}"
        for page in req.pages[own_from:]:
            assert page not in owned, f"page {page} owned by rids {owned[page]} and {req.rid}"
            owned[page] = req.rid
    shared = {page for req in scheduler.running for page in req.pages[: req.shared_pages]}
    assert shared.isdisjoint(owned), "a page is both cache-owned and request-owned"
    for req in scheduler.waiting:
        assert req.row is None and not req.pages and req.cache_handle is None and req.cached_len == 0
        assert not req.finished and scheduler.reqs.get(req.rid) is req
    assert len(scheduler.reqs) == len(scheduler.running) + len(scheduler.waiting)
    total = alloc.num_free + cache.cached_pages + len(owned)
    assert total == alloc.num_pages, (
        f"page leak: free {alloc.num_free} + cached {cache.cached_pages} + owned {len(owned)} != {alloc.num_pages}"
    )
