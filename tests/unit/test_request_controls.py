"""`RequestControls` alone (no engine, no tokenizer): which requests the engine must treat as
controlled, penalty state released when a request leaves, grammar matchers advanced per token,
prompt logprobs gathered until the first output token. Also `resolve` of the scheduler config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.engine.step import PromptChunk
from minisgl.scheduler.config import SchedulerConfig, resolve
from minisgl.scheduler.controls import RequestControls


@dataclass
class FakeGrammar:
    allowed: set[int]
    stop: int
    terminated: bool = False
    accepted: list[int] = field(default_factory=list)

    def accept(self, token: int) -> bool:
        if token not in self.allowed:
            return False
        self.accepted.append(token)
        self.terminated = token == self.stop
        return True


class FakeGrammarBackend:
    def __init__(self) -> None:
        self.built: list[str] = []

    def new_state(self, sampling: SamplingParams) -> FakeGrammar:
        if sampling.regex == "bad(":
            raise ValueError("the regex does not compile")
        self.built.append(sampling.regex or "")
        return FakeGrammar({1, 2, 3}, stop=3)


def make_controls() -> tuple[RequestControls, list[FakeGrammarBackend]]:
    backends: list[FakeGrammarBackend] = []

    def factory() -> Any:
        backends.append(FakeGrammarBackend())
        return backends[-1]

    return RequestControls(factory), backends


def req_of(rid: int, **sampling: Any) -> Req:
    return Req(rid, [5, 6, 7], SamplingParams(**sampling))


def test_plain_requests_need_no_controls() -> None:
    controls, backends = make_controls()
    controls.add(0, SamplingParams())
    controls.add(1, SamplingParams(temperature=0.0, top_k=5, stop_token_ids=[3]))
    assert not controls.any_controls and not controls.wants_logprobs and not controls.grammars
    assert not backends  # the grammar backend is built on the first constrained request only


@pytest.mark.parametrize("sampling", [
    {"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}, {"presence_penalty": -0.5},
    {"logit_bias": {4: 2.0}}, {"min_tokens": 2}, {"logprobs": 0}, {"prompt_logprobs": 1}, {"regex": "a+"},
])
def test_each_control_marks_the_request_until_it_leaves(sampling: dict[str, Any]) -> None:
    controls, _ = make_controls()
    controls.add(0, SamplingParams())
    controls.add(1, SamplingParams(**sampling))
    assert controls.any_controls
    assert controls.wants_logprobs == ("logprobs" in sampling or "prompt_logprobs" in sampling)
    assert (1 in controls.grammars) == ("regex" in sampling)
    controls.forget(req_of(1, **sampling))
    assert not controls.any_controls and not controls.wants_logprobs and not controls.grammars


def test_penalised_requests_are_released_once_to_the_next_plan() -> None:
    controls, _ = make_controls()
    samplings: list[dict[str, Any]] = [{"repetition_penalty": 1.1}, {}, {"presence_penalty": 1.0}]
    for rid, sampling in enumerate(samplings):
        controls.add(rid, SamplingParams(**sampling))
        controls.forget(req_of(rid, **sampling))
    assert controls.take_released() == [0, 2]
    assert controls.take_released() == []


def test_a_grammar_that_does_not_compile_registers_nothing() -> None:
    controls, backends = make_controls()
    with pytest.raises(ValueError, match="does not compile"):
        controls.add(0, SamplingParams(regex="bad(", logprobs=1))
    assert not controls.any_controls and not controls.wants_logprobs and not controls.grammars
    controls.add(1, SamplingParams(regex="a"))
    controls.add(2, SamplingParams(regex="b"))
    assert len(backends) == 1 and backends[0].built == ["a", "b"]  # one backend, built once


def test_accept_advances_the_matcher_and_ends_on_its_stop_or_a_violation() -> None:
    controls, _ = make_controls()
    controls.add(0, SamplingParams(regex="x"))
    req, grammar = req_of(0, regex="x"), controls.grammars[0]
    assert controls.accept(req, grammar, 1, None) is None
    assert controls.accept(req, grammar, 2, "length") == "length"  # the request's own reason stays
    assert controls.accept(req, grammar, 3, None) == "stop"  # the grammar accepted its end
    assert grammar.accepted == [1, 2, 3]  # type: ignore[attr-defined]
    fresh = FakeGrammar({1}, stop=1)
    assert controls.accept(req, fresh, 9, None) == "stop"  # type: ignore[arg-type]  # outside the grammar


@dataclass
class FakeStep:
    chunks: list[tuple[PromptChunk, list[Any]]]

    def prompt_logprob_chunks(self) -> list[tuple[PromptChunk, list[Any]]]:
        return self.chunks


def entry(value: float) -> tuple[float, list[tuple[int, float]]]:
    return (value, [(0, value)])


def test_prompt_logprobs_are_gathered_chunk_by_chunk_until_the_first_output() -> None:
    controls, _ = make_controls()
    req = Req(0, list(range(1, 8)), SamplingParams(prompt_logprobs=1))
    controls.add(0, req.sampling)
    # Targets are prompt positions 1..6, in two chunks: [1, 4) and [4, 7).
    controls.collect_prompt_logprobs(FakeStep([(PromptChunk(req, 1, 3), [entry(-1), entry(-2), entry(-3)])]))
    # A recomputation (after retraction) of the first chunk replaces what was gathered from there.
    controls.collect_prompt_logprobs(FakeStep([(PromptChunk(req, 1, 3), [entry(-1), entry(-2), entry(-3)])]))
    controls.collect_prompt_logprobs(FakeStep([(PromptChunk(req, 4, 3), [entry(-4), entry(-5), entry(-6)])]))
    req.output_ids.append(9)  # the first output token is known: later chunks are recomputations
    controls.collect_prompt_logprobs(FakeStep([(PromptChunk(req, 4, 3), [entry(-40)] * 3)]))
    got = controls.take_prompt_logprobs(0)
    assert got == [(None, []), *(entry(-k) for k in range(1, 7))]
    assert controls.take_prompt_logprobs(0) == [(None, [])]  # taken once


def test_resolve_makes_the_automatic_choices_once() -> None:
    @dataclass(frozen=True)
    class Platform:
        name: str

        def offline_prefill_tokens(self) -> int:
            return 16384

    auto = SchedulerConfig(max_prefill_tokens=None, overlap=None)
    assert resolve(auto, Platform("cuda")) == SchedulerConfig(max_prefill_tokens=16384, overlap=True)
    assert resolve(auto, Platform("cpu")) == SchedulerConfig(max_prefill_tokens=16384, overlap=False)
    fixed = SchedulerConfig(max_prefill_tokens=64, overlap=False)
    assert resolve(fixed, Platform("cuda")) == fixed
    assert resolve(SchedulerConfig(overlap=True), Platform("cpu")).overlap is True


def test_cpu_offline_prefill_takes_2048_token_chunks() -> None:
    """The CPU platform's offline budget (measured 1.1x the throughput of 8192-token chunks on
    W2's prompts); a budget the caller sets, and SchedulerConfig's own default, stay as they are."""
    from minisgl.platform.cpu import CpuPlatform

    cpu = CpuPlatform()
    assert resolve(SchedulerConfig(max_prefill_tokens=None), cpu).max_prefill_tokens == 2048
    assert resolve(SchedulerConfig(max_prefill_tokens=8192), cpu).max_prefill_tokens == 8192
    assert resolve(SchedulerConfig(), cpu).max_prefill_tokens == 8192  # SchedulerConfig's own default
