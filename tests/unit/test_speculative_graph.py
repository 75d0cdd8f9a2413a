"""CUDA graphs cover speculative decoding's verify step, checked on CPU: the graphs are captured up
to 1 + K decode entries per running request, and every step after the prefill (verify rows, and
the plain decodes near the end) is a decode batch that a captured size replays."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.attention.batch import ForwardBatch
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.bench.spec import FixedProposer
from minisgl.engine.graph import EagerGraphs, GraphRunner, graph_batch_sizes, graph_capacity, replay_size
from minisgl.layers.attention import AttentionLayer
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_graph")
    make_tiny_model("llama", path)
    return str(path)


def test_graph_capacity_counts_verify_entries():
    assert graph_capacity(256, 1) == 1
    assert graph_capacity(256, 1, 5) == 5  # one request's verify row: K + 1 entries
    assert graph_capacity(256, 8, 5) == 40
    assert graph_capacity(256, 256, 5) == 256  # the flag still caps it
    assert graph_capacity(0, 8, 5) == 0  # graphs off


def test_graph_sizes_follow_verify_rows():
    """Plain engines take the ladder; a speculating one the request ladder and its multiples of
    1 + K (one request with K = 4: the 1- and 5-entry steps only), always up to the capacity."""
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(5, 1, 5) == [1, 5]
    assert graph_batch_sizes(15, 3, 5) == [1, 2, 3, 5, 10, 15]
    assert graph_batch_sizes(40, 8, 5) == [1, 2, 4, 5, 8, 10, 20, 40]
    big = graph_batch_sizes(256, 256, 5)  # the plain ladder to 256, plus 5, 10, 20, 40, 80, 160, 240
    assert set(graph_batch_sizes(256)) < set(big) and {5, 10, 20, 40, 80, 160, 240} < set(big)
    assert big == sorted(big) and big[-1] == 256
    assert graph_batch_sizes(7, 1, 8) == [1, 7]  # the flag's cap (7) below one verify row (9)
    for sizes in (big, graph_batch_sizes(15, 3, 5)):  # any entry count up to the top replays
        assert all(replay_size(sizes, _decode(bs)) >= bs for bs in range(1, sizes[-1] + 1))


def _decode(bs: int) -> ForwardBatch:
    ids = torch.zeros(bs, dtype=torch.int64)
    lens = torch.ones(bs, dtype=torch.int32)
    return ForwardBatch(phase="decode", input_ids=ids, positions=ids, out_loc=ids, rows=ids, seq_lens=lens,
                        extend_lens=lens, extend_starts=lens, token_table=ids.view(bs, 1), seq_lens_cpu=[1] * bs,
                        extend_lens_cpu=[1] * bs, sample_idx=ids)  # fmt: skip


class _Recording:
    """Runs eagerly (CPU) and records the captured size each batch would replay (None: eager)."""

    def __init__(self, inner, sizes: list[int]) -> None:
        self.inner = inner
        self.sizes = sizes
        self.seen: list[tuple[str, int, int | None]] = []

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.seen.append((batch.phase, batch.batch_size, replay_size(self.sizes, batch)))
        return self.inner.run(batch)

    def stage_decode(self, *args, **kwargs) -> ForwardBatch | None:
        return self.inner.stage_decode(*args, **kwargs)  # an eager runner's: None (the batch is built)


@pytest.mark.parametrize("running", [1, 3])
def test_verify_steps_take_the_graph_path(model_dir, running):
    k = 4
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=running,
              speculative_algorithm="ngram", num_speculative_tokens=k)  # fmt: skip
    cfg = llm.engine.config
    assert cfg.decode_entries_per_request == k + 1  # build_scheduler tells the engine a verify row's size
    # What Engine._make_runner captures on CUDA for this config.
    capacity = graph_capacity(cfg.cuda_graph_max_bs, cfg.max_running_requests, cfg.decode_entries_per_request)
    sizes = graph_batch_sizes(capacity, cfg.max_running_requests, cfg.decode_entries_per_request)
    assert sizes[-1] == running * (k + 1)
    llm.scheduler.spec.proposer = FixedProposer()  # K proposals every step, whatever the model
    recording = _Recording(llm.engine.runner, sizes)
    llm.engine.runner = recording
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(running)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.scheduler.spec.stats
    assert stats.verify_steps > 0
    decodes = [(bs, size) for phase, bs, size in recording.seen if phase == "decode"]
    # Every step but the prefill is a decode batch, replayed by a captured size.
    assert len(decodes) == len(recording.seen) - 1
    assert all(size is not None and size >= bs for bs, size in decodes)
    assert max(bs for bs, _ in decodes) == running * (k + 1)  # all requests verifying K proposals at once
    # The recording changed nothing: greedy equals decoding without speculation.
    plain = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=running)
    assert got == [r.outputs[0].token_ids for r in plain.generate(prompts, params, use_tqdm=False)]


def test_deferred_outputs_come_back_after_the_next_launch(model_dir):
    """Speculation with overlap asked for (CUDA's default): each `step()` completes the step the
    last call launched, launches the next, then returns the completed step's outputs, so the
    caller's work on them overlaps the device; the tokens are those of the synchronous order."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=1, overlap=True,
              speculative_algorithm="ngram", num_speculative_tokens=4)  # fmt: skip
    sched = llm.scheduler
    assert sched.defer_outputs and not sched.overlap
    sched.spec.proposer = FixedProposer()
    recording = _Recording(llm.engine.runner, [])
    llm.engine.runner = recording
    sched.add_request(1 << 40, prompt, params)
    tokens: list[int] = []
    calls = 0
    while sched.has_work():
        outs = sched.step()
        calls += 1
        launches = len(recording.seen)
        if calls == 1:
            assert outs == [] and launches == 1  # the prefill launched, nothing completed yet
            continue
        assert len(outs) == 1  # the step launched by the call before
        tokens += outs[0].token_ids
        if outs[0].finish_reason is None:
            assert launches == calls  # the next step was launched before these outputs came back
        else:
            assert launches == calls - 1 and not sched.has_work()
    assert sched.spec.stats.verify_steps > 0
    plain = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=1)
    assert tokens == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


class _ReplayableTorch(TorchAttnBackend):
    """The torch backend with the graph hooks, for a `GraphRunner` on CPU (`EagerGraphs`, whose
    replay runs the captured forward again): a replay plans the captured batch afresh from the
    runner's static buffers and the host lengths the runner hands `prepare_for_replay`, at its
    first attention call, as the Triton kernels read the token table inside the graph (after the
    graph's own first node has written the step's entries)."""

    def init_graph_state(self, max_bs: int) -> None:
        self.captured: dict[int, ForwardBatch] = {}
        self.replaying: ForwardBatch | None = None

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self.captured[batch.batch_size] = batch
        self.prepare(batch)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        captured = self.captured[batch.batch_size]
        assert captured.rows.data_ptr() == batch.rows.data_ptr()  # the runner's buffers
        captured.seq_lens_cpu = list(batch.seq_lens_cpu)
        assert captured.seq_lens.tolist() == captured.seq_lens_cpu  # the device lengths were staged
        self.replaying = captured

    def forward(self, q, k, v, layer_id, batch):  # type: ignore[no-untyped-def]
        if self.replaying is not None and batch is self.replaying:
            self.replaying = None
            self.prepare(batch)  # reads the token table as the replay finds it
        return super().forward(q, k, v, layer_id, batch)


class _CountingRunner(GraphRunner):
    """Counts the decode steps that reached the static buffers through `stage_decode`."""

    staged_steps = 0

    def stage_decode(self, *args, **kwargs):
        batch = super().stage_decode(*args, **kwargs)
        self.staged_steps += batch is not None
        return batch


class _CopyingRunner(_CountingRunner):
    """Stages nothing: every replay's inputs are copied in by `run` (the path of LongRoPE rows and
    partial gathers), padding entries set to the scratch row and slot there."""

    def stage_decode(self, *args, **kwargs):
        return None


def _cpu_graph_runner(llm, runner_type: type[_CountingRunner] = _CountingRunner) -> _CountingRunner:
    """What Engine._make_runner builds on CUDA for this engine's config, on CPU: the graphs'
    sizes, and a replay computing what the captured forward computes on the static buffers."""
    engine, cfg = llm.engine, llm.engine.config
    mc = engine.model_config
    backend = _ReplayableTorch(engine.pool, *engine.attn_shape, mc.head_dim, mc.softmax_scale)
    for module in engine.model.modules():
        if isinstance(module, AttentionLayer):
            module.bind(backend)
    capacity = graph_capacity(cfg.cuda_graph_max_bs, cfg.max_running_requests, cfg.decode_entries_per_request)
    sizes = graph_batch_sizes(capacity, cfg.max_running_requests, cfg.decode_entries_per_request)
    return runner_type(engine.model, backend, engine.token_table, sizes, engine.scratch_row,
                       engine.pool.scratch_slot, engine.device, graphs=EagerGraphs(), pin_memory=False)  # fmt: skip


@pytest.mark.parametrize("speculative", [None, "ngram", "fixed"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("running", [1, 3])
def test_staged_replays_equal_eager_decoding(model_dir, speculative, overlap, running):
    """Decode steps reach a graph's static buffers in one packed copy (`GraphRunner.stage_decode`),
    padding entries included (n-gram proposals of fewer than K tokens pad a verify step up to a
    captured size; three requests take sizes between), the in-flight tokens gathered on the device
    with overlap: greedy ids equal eager decoding without speculation, every decode step replayed,
    no page held at idle."""
    spec = {} if speculative is None else {"speculative_algorithm": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=running, overlap=overlap,
              **spec)  # fmt: skip
    if speculative == "fixed":
        llm.scheduler.spec.proposer = FixedProposer()
    runner = llm.engine.runner = _cpu_graph_runner(llm)
    prompts = [[5 + i, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5 + i][: 11 - i] for i in range(running)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    llm.scheduler.check_idle_invariants()
    assert runner.replays > 0 and runner.staged_steps == runner.replays
    if speculative is not None:
        assert llm.scheduler.spec.stats.verify_steps > 0
    plain = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=running)
    assert got == [r.outputs[0].token_ids for r in plain.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("overlap", [False, True])
def test_copied_replays_equal_eager_decoding(model_dir, overlap):
    """Replays whose inputs `run` copies in (no `stage_decode`), three requests with n-gram
    proposals (padded steps between captured sizes): the graph's token-table write reads the
    slots and padding `run` set, greedy ids equal eager decoding without speculation."""
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=3, overlap=overlap,
              speculative_algorithm="ngram", num_speculative_tokens=4)  # fmt: skip
    runner = llm.engine.runner = _cpu_graph_runner(llm, _CopyingRunner)
    prompts = [[5 + i, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5 + i][: 11 - i] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    llm.scheduler.check_idle_invariants()
    assert runner.replays > 0 and runner.staged_steps == 0
    assert llm.scheduler.spec.stats.verify_steps > 0
    plain = LLM(model_dir, device="cpu", page_size=4, num_pages=512, max_running_requests=3)
    assert got == [r.outputs[0].token_ids for r in plain.generate(prompts, params, use_tqdm=False)]
