"""`LLM.embed`: embedding requests through the same tokenizer stage and scheduler as the server,
with vLLM-shaped results (`EmbeddingRequestOutput.outputs.embedding`).

Each prompt becomes one prefill-only request (`PoolingParams`); the scheduler batches them like
any prompts (prefix cache, chunked prefill) and hands back each vector with its last output.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from minisgl.core import PoolingParams, SamplingParams
from minisgl.message.tokenizer import Prompt, TextPrompt, TokenizeMsg, TokenPrompt
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.request import RequestTokenizer

# An embedding request samples nothing; its one "token" of room is what the checks count.
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's shape). `num_cached_tokens`: prompt tokens the prefix
    cache held (the last token is always computed)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0


def floats(embedding: bytes) -> list[float]:
    """A float32 little-endian vector as Python floats."""
    values = array("f")
    values.frombytes(embedding)
    return values.tolist()


def embed_inputs(prompts: str | list[int] | Sequence[str | list[int]]) -> list[Prompt]:
    """One prompt (a string, or token ids) or many, as the tokenizer stage's prompts."""
    single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
    items: list[Any] = [prompts] if single else list(prompts)
    return [TextPrompt(p) if isinstance(p, str) else TokenPrompt([int(t) for t in p]) for p in items]


def embed_prompts(scheduler: Scheduler, requests: RequestTokenizer, prompts: list[Prompt], first_rid: int,
                  dimensions: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:  # fmt: skip
    """One `EmbeddingRequestOutput` per prompt, in order (request ids from `first_rid` on). A
    prompt the checks refuse raises ValueError (the server's message) after the queued ones
    are aborted."""
    pooling = PoolingParams(dimensions)
    results: dict[int, EmbeddingRequestOutput] = {}
    order: list[int] = []
    try:
        for rid, prompt in enumerate(prompts, start=first_rid):
            msg = TokenizeMsg(rid, prompt, POOLING_SAMPLING, True, pooling=pooling)
            ids = requests.tokenize(msg).msg.input_ids
            scheduler.add_request(rid, ids, POOLING_SAMPLING, pooling)
            order.append(rid)
            results[rid] = EmbeddingRequestOutput(str(rid), EmbeddingOutput([]), ids, finished=False)
        with tqdm(total=len(order), desc="Embedding", unit="req", disable=not use_tqdm) as bar:
            pending = len(order)
            while pending:
                for out in scheduler.step():
                    result = results.get(out.rid)
                    if result is None or out.embedding is None:
                        continue
                    result.outputs.embedding = floats(out.embedding)
                    result.num_cached_tokens = out.cached_tokens
                    result.finished = True
                    pending -= 1
                    bar.update(1)
    except BaseException:
        for rid in order:
            if not results[rid].finished:
                scheduler.abort(rid)
        raise
    return [results[rid] for rid in order]
