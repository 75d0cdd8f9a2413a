"""The host time a speculative verify step spends before its graph replays, staged against legacy.

A bs=1 verify step (K proposals, `FixedProposer`: K every step) cannot be planned before the step
before it completes, so its host work from the start of `Scheduler.step()` (acceptance, the next
proposals, the batch build, the runner's input copies and `prepare_for_replay`) up to the graph
replay is exposed on the device (docs/speculative.md). This probe times that span per step in one
process, alternating passes of two modes of one graph runner:
- `staged`: this tree's path, the decode inputs in one packed copy (`GraphRunner.stage_decode`)
  and the backend's order copy skipped when unchanged;
- `legacy`: the earlier path, the batch built by `Engine._build` (`upload_many`, the token-table
  write) and copied in by `GraphRunner.run` (the input block, the lengths), and the order copied
  on every replay.

CPU (Triton interpreted, a replay does nothing: host time only, thread CPU time, load printed):
    python tools/probe_verify_host.py
GPU (real graphs; the span in wall time, which there includes the wait for the step before,
and the median `Scheduler.step()` wall time of each mode):
    python tools/probe_verify_host.py --device cuda --model configs/qwen3-0.6b

Research tool, not product code. Findings: docs/performance.md ("Speculative verify step, host
time") and docs/speculative.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if not any("cuda" in arg for arg in sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: Triton's kernels interpreted (capture only)

import torch  # noqa: E402

from minisgl.attention.triton_backend import TritonAttnBackend  # noqa: E402
from minisgl.bench.spec import FixedProposer  # noqa: E402
from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine.config import EngineConfig  # noqa: E402
from minisgl.engine.graph import CudaGraphs, GraphRunner, graph_batch_sizes  # noqa: E402
from minisgl.layers.attention import AttentionLayer  # noqa: E402
from minisgl.scheduler.build import build_scheduler  # noqa: E402
from minisgl.scheduler.config import SchedulerConfig  # noqa: E402

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 0, "bos_token_id": 0}  # fmt: skip


class _Replay:
    """A captured graph (None on CPU: nothing to replay) that notes when each replay starts."""

    def __init__(self, graph: object | None, marks: list[float], clock: Callable[[], float]) -> None:
        self.graph = graph
        self.marks = marks
        self.clock = clock

    def replay(self) -> None:
        self.marks.append(self.clock())
        if self.graph is not None:
            self.graph.replay()  # type: ignore[attr-defined]


class MarkedGraphs:
    """Captures through `CudaGraphs` (CUDA) or not at all (CPU), noting each replay's start."""

    def __init__(self, cuda: bool, clock: Callable[[], float]) -> None:
        self.inner = CudaGraphs() if cuda else None
        self.marks: list[float] = []
        self.clock = clock

    def synchronize(self) -> None:
        if self.inner is not None:
            self.inner.synchronize()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[_Replay, torch.Tensor]:
        if self.inner is None:
            return _Replay(None, self.marks, self.clock), forward()
        graph, out = self.inner.capture(forward)
        return _Replay(graph, self.marks, self.clock), out


class ProbeBackend(TritonAttnBackend):
    legacy = False

    def prepare_for_replay(self, batch):  # type: ignore[no-untyped-def]
        if self.legacy and self._graph is not None:
            self._graph.staged_order = None  # the order copied on every replay, as before
        super().prepare_for_replay(batch)


class ProbeRunner(GraphRunner):
    legacy = False

    def stage_decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None if self.legacy else super().stage_decode(*args, **kwargs)  # None: the engine builds it


def _tiny_model(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY))
    return str(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a config directory (dummy weights); default: a tiny Qwen3")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200, help="output tokens per pass")
    parser.add_argument("--passes", type=int, default=6, help="passes, alternating the modes")
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    clock = time.perf_counter if cuda else time.thread_time
    model = args.model or _tiny_model(Path(tempfile.mkdtemp()) / "tiny_qwen3")
    engine_cfg = EngineConfig(model=model, device=args.device, dummy_weights=True, attn="triton",
                              cuda_graph_max_bs=0, num_pages=2048, page_size=16 if cuda else 4)  # fmt: skip
    sched_cfg = SchedulerConfig(max_running_requests=1, cache="naive", overlap=True,
                                speculative_algorithm="ngram", num_speculative_tokens=args.k)  # fmt: skip
    engine, sched = build_scheduler(engine_cfg, sched_cfg)  # no graphs of its own (cuda_graph_max_bs 0)
    assert sched.defer_outputs
    sched.spec.proposer = FixedProposer()
    mc = engine.model_config
    backend = ProbeBackend(engine.pool, *engine.attn_shape, mc.head_dim, mc.softmax_scale)
    for module in engine.model.modules():
        if isinstance(module, AttentionLayer):
            module.bind(backend)
    graphs = MarkedGraphs(cuda, clock)
    sizes = graph_batch_sizes(1 + args.k, 1, 1 + args.k)
    runner = ProbeRunner(engine.model, backend, engine.token_table, sizes, engine.scratch_row,
                         engine.pool.scratch_slot, engine.device, graphs=graphs, pin_memory=cuda)  # fmt: skip
    engine.runner = runner
    prompt = list(range(10, 10 + args.prompt_len))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    spans: dict[str, list[float]] = {"staged": [], "legacy": []}
    steps: dict[str, list[float]] = {"staged": [], "legacy": []}
    for index in range(args.passes + 2):  # the first two warm up
        mode = "legacy" if index % 2 else "staged"
        runner.legacy = backend.legacy = mode == "legacy"
        sched.add_request(index, prompt, params)
        pass_spans, pass_steps = [], []
        while sched.has_work():
            graphs.marks.clear()
            start, wall = clock(), time.perf_counter()
            sched.step()
            pass_steps.append(time.perf_counter() - wall)
            if graphs.marks:
                pass_spans.append(graphs.marks[0] - start)
        engine.platform.synchronize()
        if index >= 2:
            spans[mode] += pass_spans[3:-6]  # the steady state: no prefill, K proposals fit
            steps[mode] += pass_steps[3:-6]
    sched.check_idle_invariants()
    out = {"device": args.device, "k": args.k, "clock": "wall" if cuda else "thread",
           "load": os.getloadavg()[0], "verify_steps": sched.spec.stats.verify_steps}  # fmt: skip
    for mode in spans:
        out[f"{mode}_to_replay_us"] = round(1e6 * statistics.median(spans[mode]), 1)
        out[f"{mode}_step_ms"] = round(1e3 * statistics.median(steps[mode]), 3)
        out[f"{mode}_samples"] = len(spans[mode])
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
