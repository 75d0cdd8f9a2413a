"""Embeddings equal transformers' with the same pooling (the last token's final hidden state,
L2-normalized) on tiny random Qwen3 models in fp32, through the real scheduler: a batch of
different lengths, prefix-cache hits, chunked prefill, overlap scheduling, Matryoshka dimensions.
And sentence-transformers itself, where it is installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl.llm import LLM
from tests.embed_models import make_tiny_embedder, reference_embeddings
from tests.tiny_models import make_tiny_model

TOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, [100, 200], list(range(40, 77))]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_embedder")
    make_tiny_embedder(path)
    return path


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", page_size=4, num_pages=128, **kwargs)


def _check(outs: list, refs: list[torch.Tensor]) -> None:
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < TOL
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_headless_checkpoint_is_an_embedding_model(embedder: Path) -> None:
    """A `Qwen3Model` checkpoint with sentence-transformers pooling: embeddings without --task."""
    llm = _llm(embedder)
    assert llm.engine.task == "embed" and llm.engine.pooler is not None
    assert llm.engine.model.lm_head is None
    outs = llm.embed(PROMPTS, use_tqdm=False)  # one batch of different lengths
    _check(outs, reference_embeddings(embedder, PROMPTS))
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    llm.scheduler.check_idle_invariants()  # every page back in the pool or the prefix cache


def test_causal_lm_with_task_embed(tmp_path: Path) -> None:
    make_tiny_model("qwen3", tmp_path)
    llm = _llm(tmp_path, task="embed")
    assert llm.engine.task == "embed" and llm.engine.model.lm_head is None
    _check(llm.embed(PROMPTS, use_tqdm=False), reference_embeddings(tmp_path, PROMPTS))


def test_prefix_cache_hits_still_compute_the_last_token(embedder: Path) -> None:
    llm = _llm(embedder)
    base = list(range(60, 84))  # 24 tokens: 6 pages of 4
    first = llm.embed([base], use_tqdm=False)
    again = llm.embed([base, base + [7, 8, 9], base[:13]], use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    # The same prompt matches all but its last page (the last token is always computed).
    assert again[0].num_cached_tokens == 20
    assert again[1].num_cached_tokens == 24 and again[2].num_cached_tokens == 12
    _check(first + again, reference_embeddings(embedder, [base, base, base + [7, 8, 9], base[:13]]))
    assert again[0].outputs.embedding == pytest.approx(first[0].outputs.embedding, abs=TOL)


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill(embedder: Path, overlap: bool) -> None:
    """Prompts longer than the step budget: only the final chunk's last row is pooled."""
    llm = _llm(embedder, max_prefill_tokens=8, overlap=overlap)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    _check(outs, reference_embeddings(embedder, PROMPTS))
    llm.scheduler.check_idle_invariants()


def test_matryoshka_dimensions(embedder: Path) -> None:
    llm = _llm(embedder)
    outs = llm.embed(PROMPTS[:2], dimensions=16, use_tqdm=False)
    _check(outs, reference_embeddings(embedder, PROMPTS[:2], dimensions=16))
    with pytest.raises(ValueError, match="between 1 and 64"):
        llm.embed([[1, 2]], dimensions=65, use_tqdm=False)
    assert llm.embed([[1, 2]], dimensions=64, use_tqdm=False)[0].outputs.hidden_size == 64


def test_dimensions_refused_without_matryoshka(tmp_path: Path) -> None:
    make_tiny_embedder(tmp_path, matryoshka=False)
    llm = _llm(tmp_path)
    with pytest.raises(ValueError, match="matryoshka.*must be 64"):
        llm.embed([[1, 2, 3]], dimensions=32, use_tqdm=False)
    assert llm.embed([[1, 2, 3]], dimensions=64, use_tqdm=False)[0].outputs.hidden_size == 64


def test_tasks_refuse_each_others_requests(embedder: Path, tmp_path: Path) -> None:
    llm = _llm(embedder)
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    make_tiny_model("qwen3", tmp_path)
    generator = _llm(tmp_path)
    assert generator.engine.task == "generate"
    with pytest.raises(ValueError, match="text-generation model"):
        generator.embed([[1, 2, 3]], use_tqdm=False)
    with pytest.raises(ValueError, match="without its LM head"):
        _llm(embedder, task="generate")


def test_matches_sentence_transformers(tmp_path: Path) -> None:
    """sentence-transformers' own pipeline (its tokenizer call, last-token pooling, Normalize)."""
    st = pytest.importorskip("sentence_transformers")
    from tests.e2e.tp_models import copy_embedded_tokenizer

    make_tiny_embedder(tmp_path, vocab_size=49152)
    copy_embedded_tokenizer(tmp_path)
    texts = ["The capital of France is Paris.", "Hello", "Embeddings from a decoder: the last token's state."]
    expected = st.SentenceTransformer(str(tmp_path), device="cpu").encode(texts, convert_to_tensor=True)
    outs = _llm(tmp_path).embed(texts, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert (got - expected.float()).abs().max().item() < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_cuda_matches_transformers(embedder: Path, dtype: str, tol: float) -> None:
    """The Triton backend on the GPU (eager: an embedding engine captures no graphs), overlap on."""
    llm = LLM(str(embedder), device="cuda", dtype=dtype, page_size=16, num_pages=64, max_prefill_tokens=16)
    assert llm.engine.runner.__class__.__name__ == "EagerRunner"
    outs = llm.embed(PROMPTS + PROMPTS[:2], use_tqdm=False)  # the repeats hit the prefix cache
    for out, ref in zip(outs, reference_embeddings(embedder, PROMPTS + PROMPTS[:2])):
        assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() < tol
    llm.scheduler.check_idle_invariants()
