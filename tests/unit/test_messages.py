"""Every wire type round-trips through the msgpack codec; the codec refuses unknown types."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minisgl.core import PoolingParams, SamplingParams
from minisgl.message import (
    AbortMsg,
    ChatPrompt,
    DetokenizedMsg,
    DetokenizeQueryMsg,
    DetokFacts,
    EmbeddingMsg,
    EmbeddingOut,
    EngineLimitsMsg,
    ErrorMsg,
    FinishedMsg,
    LoraAdapterMsg,
    LoraAdapterReplyMsg,
    QueryErrorMsg,
    ShutdownMsg,
    StatsMsg,
    StatsReqMsg,
    TextDelta,
    TextDeltaMsg,
    TextPrompt,
    TokenizedMsg,
    TokenizeMsg,
    TokenizeQueryMsg,
    TokenLogprob,
    TokenOut,
    TokenOutMsg,
    TokenPrompt,
    TokensMsg,
    TopLogprob,
    decode,
    encode,
    registered_types,
    wire,
)

SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, max_tokens=33,
                          ignore_eos=True, seed=1234, stop_token_ids=[2, 5], presence_penalty=0.5,
                          frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={7: -100.0, 9: 2.5},
                          min_tokens=3, logprobs=2, prompt_logprobs=0, json_schema='{"type": "object"}', n=3,
                          stop=["END", "\n\n"], include_stop_str_in_output=True)
TOP = TopLogprob(token_id=9, token="é", raw=b"\xc3\xa9", logprob=-0.25)
LOGPROB = TokenLogprob(token_id=3, token="\ufffd", raw=b"\xc3", logprob=-1.5, top=[TOP, TopLogprob(4, "a", b"a", -2.0)])

EXAMPLES = [
    SAMPLING,
    TokenizedMsg(rid=5, input_ids=[1, 2, 3], sampling=SAMPLING),
    EngineLimitsMsg(context_len=4096, vocab_size=49152, pool_tokens=65536),
    TokenizedMsg(rid=6, input_ids=[1], sampling=SAMPLING, facts=DetokFacts(6, [1], ["\n"], [2], True, 1, [], 1)),
    AbortMsg(rid=9),
    StatsReqMsg(query_id=3),
    ShutdownMsg(reason="bye"),
    TextPrompt("hello ✓"),
    ChatPrompt([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "yo"}]),
    TokenPrompt([0, 49151]),
    TokenizeMsg(rid=1, prompt=ChatPrompt([{"role": "system", "content": "s"}]), sampling=SAMPLING,
                max_tokens_explicit=False, stop=["\n", "END"]),
    TokenizeMsg(rid=2, prompt=TokenPrompt([4, 5])),
    TokenizeMsg(rid=3, prompt=ChatPrompt([{"role": "user", "content": "x"}],
                                         tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                         template_kwargs={"enable_thinking": False}),
                include_stop=True, echo=True),
    TokenizeQueryMsg(query_id=4, prompt=TextPrompt("hi"), add_special_tokens=False),
    DetokenizeQueryMsg(query_id=5, token_ids=[1, 2]),
    DetokFacts(rid=4, prompt_tail_ids=[7, 8], stop=["x"]),
    DetokFacts(rid=5, prompt_tail_ids=[7], stop=[], stop_token_ids=[3], include_stop=True, min_tokens=2,
               echo_ids=[1, 7], replica=2),
    TokenOut(rid=4, token_ids=[11], finish_reason=None, prompt_tokens=3, cached_tokens=1, output_tokens=1),
    TokenOut(4, [11], None, 3, 1, 1, logprobs=[[-0.5, [[11, -0.5], [12, -1.0]]]],
             prompt_logprobs=[[None, []], [-3.0, [[5, -1.0]]]]),
    TokenOutMsg([TokenOut(1, [2], "stop", 5, 0, 7), TokenOut(2, [], "abort", 1, 1, 0),
                 TokenOut(3, [4], None, 1, 0, 1, [[-0.1, []]], None)]),
    TokenOutMsg([TokenOut(1, [2], None, 5, 0, 1)], [DetokFacts(1, [3, 4], ["END"]), DetokFacts(9, echo_ids=[5])]),
    TOP,
    LOGPROB,
    TextDelta(rid=3, text="é🙂", token_ids=[1, 2], finish_reason="length", prompt_tokens=4,
              cached_tokens=2, completion_tokens=9),
    TextDelta(rid=3, text="x", token_ids=[3], finish_reason="stop", stop_reason=3, logprobs=[LOGPROB],
              prompt_text="p", prompt_logprobs=[TokenLogprob(1, "p", b"p", None, []), LOGPROB]),
    TextDeltaMsg([TextDelta(1, "a"), TextDelta(2, "", [], "stop", 1, 0, 1, "END", [LOGPROB])]),
    ErrorMsg(rid=8, message="too long", status=400, param="max_tokens"),
    StatsMsg(query_id=3, total_pages=100, free_pages=90, cached_pages=10, evictable_pages=10,
             running=0, waiting=0, prompt_tokens=40, cached_tokens=16, requests=7),
    FinishedMsg(rids=[3, 9]),
    TokensMsg(query_id=6, token_ids=[1, 2, 3]),
    DetokenizedMsg(query_id=7, text="héllo"),
    QueryErrorMsg(query_id=8, message="token id 99999 is out of range", param="tokens"),
    # Embedding requests (issue 24).
    PoolingParams(dimensions=8),
    TokenizeMsg(rid=10, prompt=TextPrompt("q"), sampling=SamplingParams(max_tokens=1), pooling=PoolingParams()),
    TokenizedMsg(rid=11, input_ids=[1, 2], pooling=PoolingParams(dimensions=32)),
    TokenOut(12, [], "stop", 2, 1, 0, embedding=b"\x00\x00\x80?"),
    EmbeddingOut(rid=14, embedding=b"\x00" * 8, prompt_tokens=3, cached_tokens=0),
    EmbeddingMsg([EmbeddingOut(12, b"\x00\x00\x80?", 2, 1), EmbeddingOut(13, b"", 1)]),
    # LoRA adapters (issue 27).
    TokenizeMsg(rid=15, prompt=TextPrompt("q"), lora="alpha"),
    TokenizedMsg(rid=16, input_ids=[1], lora="alpha"),
    LoraAdapterMsg(query_id=9, replica=1, name="alpha", path="/adapters/alpha"),
    LoraAdapterMsg(query_id=10, replica=0, name="alpha"),
    LoraAdapterReplyMsg(query_id=9, status=404, message="The lora adapter 'alpha' cannot be found."),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    back = decode(encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_every_registered_type_is_covered():
    assert set(registered_types().values()) == {type(m) for m in EXAMPLES}


def test_tags_are_unique_and_checked():
    with pytest.raises(ValueError):
        from dataclasses import dataclass

        @wire(tag=21)  # AbortMsg's tag
        @dataclass
        class Clash:
            x: int


def test_unregistered_type_refused():
    class NotWire:
        pass

    with pytest.raises(TypeError):
        encode(NotWire())


def test_unknown_tag_refused():
    import msgpack

    bad = msgpack.packb(msgpack.ExtType(1, msgpack.packb([65000, 1])))
    with pytest.raises(ValueError):
        decode(bad)


def test_message_package_does_not_import_torch():
    code = "import sys, minisgl.message, minisgl.utils.zmq; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_zmq_queues_do_not_import_the_messages():
    """utils/zmq is below message: it is handed the codec, it does not import it."""
    code = "import sys, minisgl.utils.zmq; assert 'minisgl.message' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
