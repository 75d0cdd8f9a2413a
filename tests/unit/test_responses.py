"""Response objects from deltas: tool calls, logprobs (held-back text's ride along), echo,
stop_reason, finish_reason "tool_calls"."""

from __future__ import annotations

import json

from minisgl.message.frontend import TextDelta, TokenLogprob, TopLogprob
from minisgl.server.choice import ChoiceOptions
from minisgl.server.responses import ResponseBuilder


def lp(token: str, value: float) -> TokenLogprob:
    return TokenLogprob(1, token, token.encode(), value, [TopLogprob(1, token, token.encode(), value)])


def events(chunks: list[bytes | None]) -> list[dict]:
    return [json.loads(c[6:]) for c in chunks if c is not None]


def test_chat_stream_with_hermes_call_and_logprobs():
    options = ChoiceOptions(tool_mode="auto", tool_names=("f",), logprobs=True)
    b = ResponseBuilder("chat", "m", [7], True, options)
    pieces = ["Hi ", "<tool", '_call>{"name": "f", "arguments": {"x": 1}}</tool_call>']
    chunks = [b.delta_chunk(TextDelta(7, p, [i], logprobs=[lp(p, -0.5)])) for i, p in enumerate(pieces)]
    chunks.append(b.delta_chunk(TextDelta(7, "", [3], "stop", 4, 0, 4, logprobs=[lp("", -0.1)])))
    evs = [e["choices"][0] for e in events(chunks)]
    assert evs[0]["delta"] == {"content": "Hi "} and len(evs[0]["logprobs"]["content"]) == 1
    call = evs[1]["delta"]["tool_calls"][0]
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'} and call["index"] == 0
    assert len(evs[1]["logprobs"]["content"]) == 2  # the held-back "<tool" rides with the call
    assert evs[-1]["finish_reason"] == "tool_calls" and evs[-1]["stop_reason"] is None
    full = b.full()["choices"][0]
    assert full["message"]["content"] == "Hi " and full["message"]["tool_calls"][0]["id"].startswith("call_")
    assert full["finish_reason"] == "tool_calls" and len(full["logprobs"]["content"]) == 4


def test_completion_echo_logprobs_offsets_and_stop_reason():
    b = ResponseBuilder("completion", "m", [1], True, ChoiceOptions(logprobs=True, echo=True), ["Say"])
    prompt = [TokenLogprob(5, "Say", b"Say", None, [])]
    b.add(TextDelta(1, " hi", [2], prompt_text="Say", prompt_logprobs=prompt, logprobs=[lp(" hi", -1.0)]))
    b.add(TextDelta(1, "!", [3], "stop", 1, 0, 2, stop_reason="END", logprobs=[lp("!", -2.0)]))
    choice = b.full()["choices"][0]
    assert choice["text"] == "Say hi!" and choice["stop_reason"] == "END"
    assert choice["logprobs"] == {"tokens": ["Say", " hi", "!"], "token_logprobs": [None, -1.0, -2.0],
                                  "top_logprobs": [None, {" hi": -1.0}, {"!": -2.0}], "text_offset": [0, 3, 6]}


def test_named_tool_streams_arguments_and_no_logprobs_key_when_off():
    b = ResponseBuilder("chat", "m", [1], True, ChoiceOptions(tool_mode="named", tool_names=("f",), forced_tool="f"))
    evs = [e["choices"][0] for e in events([b.delta_chunk(TextDelta(1, '{"a"', [1])),
                                            b.delta_chunk(TextDelta(1, ": 2}", [2], "stop", 1, 0, 2))])]  # fmt: skip
    assert evs[0]["delta"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert evs[1]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": ": 2}"}}
    assert evs[1]["finish_reason"] == "tool_calls" and evs[0]["logprobs"] is None
    assert b.full()["choices"][0]["message"]["content"] is None
