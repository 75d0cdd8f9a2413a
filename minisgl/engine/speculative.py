"""Speculative decoding, the engine's side: a verify row samples the target at each of its positions.

The scheduler (scheduler/speculative.py) hands the proposals in `StepPlan.drafts`; the engine puts
each speculating request's last token and its proposals in the batch as one decode entry per
position (the request's row, each entry attending up to its own position: the layers store every
entry's KV before attending, so the later entries see the earlier ones), and samples a token at
every position with the request's own sampling. A batch of decodes and verify rows is then still a
decode batch, which the CUDA graphs (captured per entry count) replay. Row i of a request stands for its output token
`output_len + i`: that is the step its seeded noise and its min_tokens ban are keyed by, so a
seeded request draws the noise it would draw decoding one token at a time.
"""

from __future__ import annotations

from minisgl.core import Req


def verify_row(req: Req, proposal: list[int]) -> list[int]:
    """The input tokens of a speculating request's verify row: its newest token (the only one
    without KV), then the proposals."""
    return [(req.output_ids or req.prompt_ids)[-1], *proposal]


def row_steps(sampled: list[Req]) -> list[int]:
    """Per sampled row, the output index its token would have: a request's consecutive rows (a
    verify row) count up from its output length."""
    steps: list[int] = []
    previous: Req | None = None
    offset = 0
    for req in sampled:
        offset = offset + 1 if req is previous else 0
        steps.append(req.output_len + offset)
        previous = req
    return steps
