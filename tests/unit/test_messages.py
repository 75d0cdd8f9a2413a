"""Every wire type round-trips through the msgpack codec; the codec refuses unknown types."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortMsg,
    ChatPrompt,
    DetokRegisterMsg,
    ErrorMsg,
    ShutdownMsg,
    StatsMsg,
    StatsReqMsg,
    TextDelta,
    TextDeltaMsg,
    TextPrompt,
    TokenizedMsg,
    TokenizeMsg,
    TokenOut,
    TokenOutMsg,
    TokenPrompt,
    decode,
    encode,
    registered_types,
    wire,
)

SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, max_tokens=33,
                          ignore_eos=True, seed=1234, stop_token_ids=[2, 5])

EXAMPLES = [
    SAMPLING,
    TokenizedMsg(rid=5, input_ids=[1, 2, 3], sampling=SAMPLING, max_tokens_explicit=False),
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
    DetokRegisterMsg(rid=4, prompt_tail_ids=[7, 8], stop=["x"]),
    TokenOut(rid=4, token_ids=[11], finish_reason=None, prompt_tokens=3, cached_tokens=1, output_tokens=1),
    TokenOutMsg([TokenOut(1, [2], "stop", 5, 0, 7), TokenOut(2, [], "abort", 1, 1, 0)]),
    TextDelta(rid=3, text="é🙂", token_ids=[1, 2], finish_reason="length", prompt_tokens=4,
              cached_tokens=2, completion_tokens=9),
    TextDeltaMsg([TextDelta(1, "a"), TextDelta(2, "", [], "stop", 1, 0, 1)]),
    ErrorMsg(rid=8, message="too long", status=400, param="max_tokens"),
    StatsMsg(query_id=3, total_pages=100, free_pages=90, cached_pages=10, evictable_pages=10,
             running=0, waiting=0),
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
