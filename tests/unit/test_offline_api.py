"""The offline API's pure parts: `LLM(...)` keywords onto the two configs, SamplingParams as the
one check of sampling values, the `n` fan-out rule, and results built from detokenizer deltas."""

from __future__ import annotations

from dataclasses import fields

import pytest

from minisgl.core import SamplingError, SamplingParams, fan_out
from minisgl.engine.config import EngineConfig
from minisgl.llm.llm import split_config
from minisgl.llm.outputs import OutputBuilder, position_logprobs
from minisgl.message.frontend import TextDelta, TokenLogprob, TopLogprob
from minisgl.scheduler.config import SchedulerConfig


def test_keywords_route_by_field_name():
    engine, sched = split_config("m", {"device": "cpu", "page_size": 4, "cache": "naive", "max_running_requests": 8,
                                       "overlap": False})  # fmt: skip
    assert (engine.model, engine.device, engine.page_size, engine.max_running_requests) == ("m", "cpu", 4, 8)
    assert (sched.cache, sched.max_running_requests, sched.overlap) == ("naive", 8, False)
    assert sched.max_prefill_tokens is None  # the offline default: the platform's
    base = SchedulerConfig(max_prefill_tokens=64, decode_reserve_tokens=3)
    _, sched = split_config(None, {"cache": "naive"}, scheduler_config=base)
    assert (sched.max_prefill_tokens, sched.decode_reserve_tokens, sched.cache) == (64, 3, "naive")
    # Every field of either config is a keyword (new config fields become LLM keywords by themselves).
    for f in [*fields(EngineConfig), *fields(SchedulerConfig)]:
        if f.name != "tp_rank":
            split_config(None, {f.name: getattr(EngineConfig() if f in fields(EngineConfig) else SchedulerConfig(), f.name)})


def test_unknown_keyword_lists_the_valid_ones():
    with pytest.raises(TypeError) as info:
        split_config(None, {"pagesize": 4})
    message = str(info.value)
    assert "pagesize" in message and "page_size" in message and "max_prefill_tokens" in message


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"n": 65}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": ["x"] * 17}, "stop"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"json_object": True, "regex": "a"}, "regex"),
])  # fmt: skip
def test_sampling_errors_name_their_field(kwargs, param):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_sampling_normalises_and_round_trips():
    sp = SamplingParams(top_k=-1, stop="END", n=2)
    assert sp.top_k is None and sp.stop == ["END"]
    assert SamplingParams.from_dict(sp.to_dict()) == sp


def test_fan_out_is_the_servers_seed_rule():
    assert [p.seed for p in fan_out(SamplingParams(n=3, seed=10))] == [10, 11, 12]
    assert all(p.n == 1 for p in fan_out(SamplingParams(n=3, seed=10)))
    unseeded = fan_out(SamplingParams(temperature=0.5), 2)
    assert [p.seed for p in unseeded] == [None, None] and unseeded[0].temperature == 0.5


def _lp(token: int, value: float, top: list[tuple[int, float]]) -> TokenLogprob:
    return TokenLogprob(token, f"t{token}", b"", value, [TopLogprob(t, f"t{t}", b"", v) for t, v in top])


def test_position_logprobs_vllm_shape():
    inside = position_logprobs(_lp(4, -0.1, [(4, -0.1), (9, -2.0)]))
    assert [(t, lp.rank, lp.decoded_token) for t, lp in inside.items()] == [(4, 1, "t4"), (9, 2, "t9")]
    outside = position_logprobs(_lp(7, -5.0, [(4, -0.1)]))
    assert outside[7].rank is None and outside[7].logprob == -5.0 and outside[4].rank == 1


def test_builder_folds_deltas_into_one_completion():
    b = OutputBuilder(1, want_logprobs=True)
    b.add(TextDelta(3, "Hel", [1, 2], logprobs=[_lp(1, -0.5, []), _lp(2, -0.25, [])], cached_tokens=4,
                    prompt_logprobs=[TokenLogprob(8, "p", b"p", None, []), _lp(9, -1.0, [(9, -1.0)])]))  # fmt: skip
    assert not b.finished
    b.add(TextDelta(3, "lo", [3], "stop", stop_reason="END", logprobs=[_lp(3, -0.25, [])], cached_tokens=4))
    out = b.out
    assert (out.index, out.text, out.token_ids, out.finish_reason, out.stop_reason) == (1, "Hello", [1, 2, 3], "stop", "END")
    assert out.logprobs is not None and len(out.logprobs) == 3 and out.cumulative_logprob == -1.0
    assert b.prompt_logprobs is not None and b.prompt_logprobs[0] is None and b.prompt_logprobs[1][9].rank == 1
    assert b.cached_tokens == 4 and b.finished


def test_kernel_switches_are_llm_keywords() -> None:
    """`LLM(pdl=False)` is `kernels=KernelConfig(pdl=False)`: the kernel switches route like the
    other config fields, and the rest of the kernel config keeps its defaults."""
    from minisgl.platform.kernel_config import KernelConfig

    engine, _ = split_config(None, {"pdl": False, "fold_norms": False, "page_size": 8})
    assert engine.kernels == KernelConfig(pdl=False, fold_norms=False) and engine.page_size == 8
    assert split_config(None, {})[0].kernels == KernelConfig()
