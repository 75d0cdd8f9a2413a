"""Embedding requests in the scheduler (fake engine: what each pooled row read through its table)
and the checkpoint facts that make a model an embedding model."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest

from minisgl.core import PoolingParams, SamplingError, SamplingParams
from minisgl.engine.pooling import embedding_bytes
from minisgl.models.config import ModelConfig
from minisgl.models.pooling import PoolerConfig, resolve_task, sentence_transformers_pooling
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler, TaskError
from tests.embed_models import write_sentence_transformers_files
from tests.unit.fake_engine import FakeEngine

ONE = SamplingParams(temperature=0.0, max_tokens=1)


def _scheduler(pooler: PoolerConfig | None = PoolerConfig(8, matryoshka=True), *, budget: int = 64,
               overlap: bool = False, num_pages: int = 64) -> Scheduler:  # fmt: skip
    engine = FakeEngine(page_size=4, num_pages=num_pages, context_len=256, pooler=pooler)
    return Scheduler(engine, SchedulerConfig(max_running_requests=8, max_prefill_tokens=budget, overlap=overlap))


def _run(sched: Scheduler) -> dict[int, tuple[list[float], int]]:
    """Step until idle: each request's fake vector (the history it read) and its cached tokens."""
    done: dict[int, tuple[list[float], int]] = {}
    for _ in range(200):
        if not sched.has_work():
            break
        for out in sched.step():
            assert out.embedding is not None and out.finish_reason == "stop" and out.token_ids == []
            done[out.rid] = (array("f", out.embedding).tolist(), out.cached_tokens)
    assert not sched.has_work()
    sched.check_idle_invariants()
    return done


@pytest.mark.parametrize("overlap", [False, True])
def test_pooled_rows_read_the_whole_prompt(overlap: bool) -> None:
    """Chunked (budget 8), batched and prefix-cached prompts: the pooled row of each is its last
    prompt token, which attended to exactly the prompt; nothing decodes; every page comes back."""
    sched = _scheduler(budget=8, overlap=overlap)
    prompts = {1: list(range(10, 31)), 2: [5, 6, 7], 3: list(range(10, 31)), 4: list(range(10, 27)) + [1]}
    for rid, ids in prompts.items():
        sched.add_request(rid, ids, ONE, PoolingParams())
    done = _run(sched)
    assert {rid: vec for rid, (vec, _) in done.items()} == {rid: [float(t) for t in ids] for rid, ids in prompts.items()}
    assert all(step.reqs for step in sched.engine.steps)  # type: ignore[attr-defined]
    for record in sched.engine.steps:  # type: ignore[attr-defined]
        assert all(r.extend_len <= 8 for r in record.reqs)
    # A repeat hits the cache for all but the page of its last token.
    sched.add_request(9, prompts[1], ONE, PoolingParams())
    vec, cached = _run(sched)[9]
    assert vec == [float(t) for t in prompts[1]] and cached == 20


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_prefill_frees_everything(overlap: bool) -> None:
    """An embedding request aborted between its chunks never answers; the others still do."""
    sched = _scheduler(num_pages=16, budget=16, overlap=overlap)
    sched.add_request(0, list(range(1, 41)), ONE, PoolingParams())  # 40 tokens: three chunks
    for rid in range(1, 4):
        sched.add_request(rid, [rid + 1] * 15, ONE, PoolingParams())
    assert sched.step() == []  # the first chunk of request 0
    assert sched.abort(0) and not sched.abort(0)
    done = _run(sched)
    assert sorted(done) == [1, 2, 3]
    for rid in range(1, 4):
        assert done[rid][0] == [float(rid + 1)] * 15


def test_task_mismatch_is_refused() -> None:
    with pytest.raises(TaskError, match="embedding model"):
        _scheduler().add_request(1, [1, 2], ONE)
    with pytest.raises(TaskError, match="text-generation model"):
        _scheduler(pooler=None).add_request(1, [1, 2], ONE, PoolingParams())
    with pytest.raises(TaskError, match="between 1 and 8") as info:
        _scheduler().add_request(1, [1, 2], ONE, PoolingParams(dimensions=9))
    assert info.value.param == "dimensions"
    with pytest.raises(SamplingError):
        PoolingParams(dimensions=0)


def test_check_dimensions() -> None:
    PoolerConfig(8).check_dimensions(None)
    PoolerConfig(8).check_dimensions(8)
    with pytest.raises(ValueError, match="does not support matryoshka.*must be 8"):
        PoolerConfig(8).check_dimensions(4)
    PoolerConfig(8, matryoshka=True).check_dimensions(1)
    with pytest.raises(ValueError, match="trained for 'dimensions' of 2, 4"):
        PoolerConfig(8, matryoshka=True, dimensions=(2, 4)).check_dimensions(3)


def test_embedding_bytes_cut_then_normalize() -> None:
    import torch

    hidden = torch.tensor([3.0, 4.0, 12.0])
    assert array("f", embedding_bytes(hidden, 2, True)).tolist() == pytest.approx([0.6, 0.8])
    assert array("f", embedding_bytes(hidden, None, False)).tolist() == [3.0, 4.0, 12.0]


def _config(path: Path, arch: str) -> ModelConfig:
    cfg = {"architectures": [arch], "vocab_size": 32, "hidden_size": 16, "num_attention_heads": 2,
           "num_hidden_layers": 1, "intermediate_size": 32}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_dir(path)


def test_task_from_the_checkpoint(tmp_path: Path) -> None:
    causal = _config(tmp_path, "Qwen3ForCausalLM")
    assert causal.has_lm_head and resolve_task("auto", tmp_path, causal) == ("generate", None)
    task, pooler = resolve_task("embed", tmp_path, causal)
    assert task == "embed" and pooler == PoolerConfig(16, normalize=True)
    headless = _config(tmp_path, "Qwen3Model")
    assert headless.architecture == "Qwen3ForCausalLM" and not headless.has_lm_head
    assert resolve_task("auto", tmp_path, headless)[0] == "embed"
    with pytest.raises(ValueError, match="without its LM head"):
        resolve_task("generate", tmp_path, headless)
    write_sentence_transformers_files(tmp_path, normalize=False)
    assert sentence_transformers_pooling(tmp_path) == ("last", False)
    assert resolve_task("auto", tmp_path, causal) == ("embed", PoolerConfig(16, normalize=False))
    write_sentence_transformers_files(tmp_path, mode="mean_tokens")
    with pytest.raises(ValueError, match="pools embeddings by 'mean_tokens'"):
        resolve_task("auto", tmp_path, causal)
    with pytest.raises(ValueError, match="unknown task"):
        resolve_task("score", tmp_path, causal)


def test_matryoshka_from_config(tmp_path: Path) -> None:
    cfg = {"architectures": ["Qwen3Model"], "vocab_size": 32, "hidden_size": 16, "num_attention_heads": 2,
           "num_hidden_layers": 1, "matryoshka_dimensions": [4, 8, 16]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, pooler = resolve_task("auto", tmp_path, ModelConfig.from_dir(tmp_path))
    assert pooler == PoolerConfig(16, True, True, (4, 8, 16))


@pytest.mark.parametrize("raw, param", [
    (b'{"input": []}', "input"), (b'{"input": true}', "input"), (b'{"input": [1, "a"]}', "input"),
    (b'{"input": ["a", ""]}', "input"), (b'{"input": [[1], []]}', "input"), (b'{}', "input"),
    (b'{"input": "a", "encoding_format": "int8"}', "encoding_format"), (b'{"input": "a", "dimensions": 0}', "dimensions"),
    (b'{"input": "a", "dimensions": 1.5}', "dimensions"), (b'{"input": "a", "pooling": "cls"}', "pooling"),
])  # fmt: skip
def test_request_errors_name_the_field(raw: bytes, param: str) -> None:
    from minisgl.server.embeddings_protocol import EmbeddingRequest
    from minisgl.server.protocol import RequestError, parse_request

    with pytest.raises(RequestError) as info:
        parse_request(EmbeddingRequest, raw)
    assert info.value.param == param and info.value.status == 400


def test_request_inputs_and_reply() -> None:
    import base64

    from minisgl.message.frontend import EmbeddingOut
    from minisgl.message.tokenizer import TextPrompt, TokenPrompt
    from minisgl.server.embeddings_protocol import EmbeddingRequest, embedding_response
    from minisgl.server.protocol import parse_request

    def prompts(raw: bytes) -> list[object]:
        return parse_request(EmbeddingRequest, raw).prompts()

    assert prompts(b'{"input": "a"}') == [TextPrompt("a")]
    assert prompts(b'{"input": [3, 4]}') == [TokenPrompt([3, 4])]
    assert prompts(b'{"input": [[3], [4, 5]]}') == [TokenPrompt([3]), TokenPrompt([4, 5])]
    assert prompts(b'{"input": ["a", "b"], "user": "u", "model": "m"}') == [TextPrompt("a"), TextPrompt("b")]
    vec = array("f", [0.6, 0.8]).tobytes()
    outs = [EmbeddingOut(1, vec, 3, 1), EmbeddingOut(2, vec, 2)]
    reply = embedding_response(outs, "m", "float")
    assert reply["object"] == "list" and reply["model"] == "m"
    assert reply["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [d["index"] for d in reply["data"]] == [0, 1] and reply["data"][0]["object"] == "embedding"
    assert reply["data"][1]["embedding"] == pytest.approx([0.6, 0.8])
    encoded = embedding_response(outs, "m", "base64")["data"][0]["embedding"]
    assert base64.b64decode(encoded) == vec
