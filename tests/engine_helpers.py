"""Drive the engine directly (no scheduler) for layer-level checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.engine import Engine
from minisgl.engine.step import StepPlan

if TYPE_CHECKING:
    from minisgl.llm import LLM


def forward_logits(
    engine: Engine,
    prompts: list[list[int]],
    prefix_lens: list[int] | None = None,
    all_positions: bool = False,
    first_page: int = 0,
) -> list[torch.Tensor]:
    """Run prompts as one extend batch on fresh pages (request i in row i).

    With `prefix_lens`, the first prefix_lens[i] tokens are computed in an earlier step, so the
    second step extends on top of a cached prefix. Returns each request's logits of its new tokens
    ([n, vocab]) when `all_positions`, else of its last token ([1, vocab]).
    """
    ps = engine.pool.page_size
    prefix_lens = prefix_lens or [0] * len(prompts)
    reqs, page = [], first_page
    original = engine.model_config.long_rope_from  # as the scheduler marks a LongRoPE prompt past it
    for row, ids in enumerate(prompts):
        req = Req(row, list(ids), SamplingParams(temperature=0), long_rope=original is not None and len(ids) > original)
        req.row = row
        n_pages = -(-len(ids) // ps)
        req.pages = list(range(page, page + n_pages))
        page += n_pages
        reqs.append(req)

    def slots(req: Req, begin: int, end: int) -> list[int]:
        return [req.pages[p // ps] * ps + p % ps for p in range(begin, end)]

    if any(prefix_lens):
        first = [r for r, n in zip(reqs, prefix_lens) if n]
        for req, n in zip(reqs, prefix_lens):
            req.extend_len = n
        engine.step(StepPlan(first, [s for r in first for s in slots(r, 0, r.extend_len)]))
        for req in first:
            req.cached_len, req.extend_len = req.extend_len, 0
    for req in reqs:
        req.extend_len = req.total_len - req.cached_len
    plan = StepPlan(reqs, [s for r in reqs for s in slots(r, r.cached_len, r.total_len)])
    batch, _ = engine.build_batch(plan)
    if all_positions:
        batch.sample_idx = torch.arange(batch.num_tokens)
    logits = engine.forward_logits(batch)
    if not all_positions:
        return list(logits.split(1))
    return list(logits.split([r.extend_len for r in reqs]))


def check_top5_at_divergence(
    llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int, what: str,
    near_tie: Callable[[LLM, list[int], int], str | None] | None = None,
) -> None:  # fmt: skip
    """bf16 parity (the GPU tests): our greedy tokens and those of transformers' `hf` (on the GPU, in
    bf16) may part, but at the first step where they do, each side's token is among the other
    side's top-5 logits at that context (the prompt and our tokens so far). Where that fails,
    `near_tie(llm, context, theirs)` may explain the divergence as a checked near-tie (None) or
    say why it is not one (the message)."""
    device = next(hf.parameters()).device
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts:
        ours = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if i is None:
            continue
        context = prompt + ours[:i]
        with torch.no_grad():
            hf_top = hf(torch.tensor([context], device=device)).logits[0, -1].topk(5).indices.tolist()
        our_top = forward_logits(llm.engine, [context], first_page=200)[0][0].topk(5).indices.tolist()
        if ours[i] in hf_top and theirs[i] in our_top:
            continue
        why = "outside the top-5" if near_tie is None else near_tie(llm, context, theirs[i])
        assert why is None, f"{what}, prompt len {len(prompt)}: divergence at {i}: {ours[i]} vs {theirs[i]}: {why}"
