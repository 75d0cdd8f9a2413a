"""Logprob entries (from the detokenizer) -> OpenAI's two response shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": None}`. Completions (legacy): parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (a {token: logprob} map per position: the chosen token and the top alternatives)
and `text_offset` (where each token starts in the choice's text, counting token texts).
"""

from __future__ import annotations

from typing import Any

from minisgl.message.frontend import TokenLogprob

_FLOOR = -9999.0  # -inf is not JSON


def _finite(value: float) -> float:
    return max(value, _FLOOR)


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    content = [
        {"token": e.token, "logprob": _finite(e.logprob if e.logprob is not None else 0.0), "bytes": list(e.raw),
         "top_logprobs": [{"token": t.token, "logprob": _finite(t.logprob), "bytes": list(t.raw)} for t in e.top]}
        for e in entries
    ]  # fmt: skip
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Builds the legacy shape, continuing text offsets across stream chunks."""

    def __init__(self) -> None:
        self.offset = 0

    def build(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for e in entries:
            tokens.append(e.token)
            offsets.append(self.offset)
            self.offset += len(e.token)
            if e.logprob is None:  # the first prompt token
                values.append(None)
                tops.append(None)
                continue
            values.append(_finite(e.logprob))
            top = {e.token: _finite(e.logprob)}
            for t in e.top:
                top.setdefault(t.token, _finite(t.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
