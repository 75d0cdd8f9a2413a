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
    """Every SSE event of the chunks (one delta may give two: its text, then its finish)."""
    return [json.loads(e[6:]) for c in chunks if c is not None for e in c.split(b"\n\n") if e]


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
    assert evs[2] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}
    assert evs[1]["finish_reason"] is None and evs[0]["logprobs"] is None
    assert b.full()["choices"][0]["message"]["content"] is None


def test_named_tool_cut_by_max_tokens_is_no_call():
    options = ChoiceOptions(tool_mode="named", tool_names=("f",), forced_tool="f")
    b = ResponseBuilder("chat", "m", [1], True, options)
    b.add(TextDelta(1, '{"a"', [1]))
    b.add(TextDelta(1, ": ", [2], "length", 1, 0, 2))
    choice = b.full()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == ""
    done = ResponseBuilder("chat", "m", [1], True, options)  # complete arguments at the limit: a call
    done.add(TextDelta(1, '{"a": 1}', [1], "length", 1, 0, 1))
    assert done.full()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


def test_required_tool_cut_by_max_tokens_keeps_only_whole_calls():
    b = ResponseBuilder("chat", "m", [1], True, ChoiceOptions(tool_mode="required", tool_names=("f",)))
    b.add(TextDelta(1, '[{"name": "f", "param', [1], "length", 1, 0, 1))
    choice = b.full()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == ""


def test_stream_n2_each_choice_opens_with_its_own_role_chunk():
    b = ResponseBuilder("chat", "m", [1, 2], True)
    evs = events([b.role_chunk()])
    assert [e["choices"] for e in evs] == [
        [{"index": i, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}]
        for i in (0, 1)
    ]  # fmt: skip


def test_chat_finish_comes_alone_completion_finish_carries_text():
    chat = ResponseBuilder("chat", "m", [1], True)
    evs = [e["choices"][0] for e in events([chat.delta_chunk(TextDelta(1, "end", [1], "length", 3, 0, 1))])]
    assert evs[0]["delta"] == {"content": "end"} and evs[0]["finish_reason"] is None
    assert evs[1]["delta"] == {} and evs[1]["finish_reason"] == "length"
    cmpl = ResponseBuilder("completion", "m", [1], True)
    evs = [e["choices"][0] for e in events([cmpl.delta_chunk(TextDelta(1, "end", [1], "length", 3, 0, 1))])]
    assert len(evs) == 1 and evs[0]["text"] == "end" and evs[0]["finish_reason"] == "length"


def test_usage_counts_each_prompt_once_with_n():
    b = ResponseBuilder("completion", "m", [1, 2, 3, 4], False, n=2)  # 2 prompts x n=2
    for rid, prompt in zip([1, 2, 3, 4], [5, 5, 7, 7]):
        b.add(TextDelta(rid, "x", [9], "length", prompt, 2, 1))
    assert b.usage()["prompt_tokens"] == 12 and b.usage()["completion_tokens"] == 4
    assert b.usage()["prompt_tokens_details"]["cached_tokens"] == 4
    shared = ResponseBuilder("chat", "m", [1, 2], True)
    for rid in (1, 2):
        shared.add(TextDelta(rid, "x", [9], "length", 5, 0, 1))
    assert shared.usage()["prompt_tokens"] == 5
