"""Speculative decoding's parts alone: n-gram lookup, acceptance, KV roll-back, the verify row's
sampling steps, the draft mirror's common prefix, config and flag checks."""

from __future__ import annotations

import argparse
import random

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.engine.speculative import row_steps, verify_row
from minisgl.scheduler.config import SchedulerConfig, resolve
from minisgl.scheduler.pages import PageManager
from minisgl.scheduler.speculative import NgramProposer, SpeculativeDecoder, can_speculate, ngram_proposal
from minisgl.scheduler.speculative_draft import common_prefix
from minisgl.server.engine_args import add_engine_args, check_engine_args, scheduler_config


def test_ngram_takes_the_latest_longest_match():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    # "2 3" last occurred before the tail at index 6 (after "1"), followed by 7 8 4.
    assert ngram_proposal(ids, 3, max_n=3, min_n=1) == [7, 8, 4]
    assert ngram_proposal(ids, 1, max_n=3, min_n=1) == [7]
    # n = 3 ("4 2 3") occurs nowhere else; n = 2 decides.
    assert ngram_proposal(ids, 5, max_n=3, min_n=2) == [7, 8, 4, 2, 3]


def test_ngram_falls_back_to_shorter_grams_and_to_nothing():
    assert ngram_proposal([5, 6, 7, 6], 2, max_n=3, min_n=1) == [7, 6]  # only the 1-gram "6" recurs
    assert ngram_proposal([5, 6, 7, 6], 2, max_n=3, min_n=2) == []
    assert ngram_proposal([1, 2, 3], 4, max_n=3, min_n=1) == []
    assert ngram_proposal([4], 4, max_n=3, min_n=1) == []
    assert ngram_proposal([4, 4], 4, max_n=3, min_n=1) == [4]  # the continuation may reach the tail


def _scan(ids: list[int], limit: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup by a plain scan: the latest earlier occurrence of the longest tail n-gram."""
    size = len(ids)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for j in range(size - 2, n - 2, -1):
            if ids[j - n + 1 : j + 1] == ids[size - n :]:
                return ids[j + 1 : j + 1 + limit]
    return []


def test_ngram_byte_search_equals_a_scan():
    """The byte search finds what a scan finds, hits off a token boundary skipped (ids whose
    bytes repeat inside other ids: small and large vocabularies)."""
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 7, 300, 70_000, 1 << 24, (1 << 31) - 1])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        limit, max_n = rng.randrange(0, 6), rng.randrange(1, 5)
        min_n = rng.randrange(1, max_n + 1)
        assert ngram_proposal(ids, limit, max_n, min_n) == _scan(ids, limit, max_n, min_n), (ids, limit, max_n, min_n)
    # 0x01000000 holds the bytes of 1 shifted by one: [1, 1 << 8] must not match [1] off a boundary.
    assert ngram_proposal([256, 1 << 24, 9, 1], 2, max_n=1, min_n=1) == []
    assert ngram_proposal([1, 7, 256, 1 << 24, 9, 1], 2, max_n=1, min_n=1) == [7, 256]


def test_ngram_proposer_over_prompt_and_output():
    req = Req(1, [10, 11, 12, 13], SamplingParams(), output_ids=[10, 11])
    assert NgramProposer(3, 1).propose([(req, 2)]) == {1: [12, 13]}
    assert NgramProposer(3, 1).propose([(Req(2, [1, 2, 3], SamplingParams()), 2)]) == {}


def _decoder(k: int = 4, page_size: int = 4, num_pages: int = 16) -> SpeculativeDecoder:
    config = SchedulerConfig(speculative_algorithm="ngram", num_speculative_tokens=k)
    return SpeculativeDecoder(config, PageManager(num_pages, page_size, "naive", 4), NgramProposer(3, 1))


def test_accept_longest_matching_prefix_plus_the_target_token():
    spec = _decoder()
    assert spec.accept([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]  # third rejected: the target's 9 instead
    assert spec.accept([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted: plus the bonus
    assert spec.accept([5, 6, 7], [4, 6, 7, 1]) == [4]  # the first rejected: one token, as plain decoding
    stats = spec.stats
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (3, 9, 5)
    assert stats.acceptance_rate == pytest.approx(5 / 9)
    assert stats.mean_accepted_len == pytest.approx(1 + 5 / 3)


def test_propose_reserves_the_row_and_respects_the_limits():
    spec = _decoder(k=4, page_size=4, num_pages=16)
    pages = spec.pages
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]
    req = Req(7, prompt, SamplingParams(max_tokens=3), output_ids=[2])  # 2 more tokens allowed
    pages.attach(req, pages.no_match())
    req.cached_len = req.total_len - 1
    assert pages.reserve(req, 1)
    req.extend_len = 1
    drafts = spec.propose([req], {})
    assert drafts == {7: [3]}  # max_tokens - output_len - 1 = 1 proposal (its successor also fits)
    assert len(req.pages) * 4 >= req.cached_len + 2
    assert spec.propose([req], {7: object()}) == {}  # a constrained request decodes plainly
    greedy_pen = Req(8, prompt, SamplingParams(max_tokens=9, presence_penalty=0.5), output_ids=[2])
    greedy_pen.extend_len = 1
    greedy_pen.cached_len = greedy_pen.total_len - 1
    assert spec.propose([greedy_pen], {}) == {}


def test_roll_back_frees_the_pages_past_the_committed_tokens():
    spec = _decoder(page_size=4, num_pages=16)
    pages = spec.pages
    req = Req(1, list(range(6)), SamplingParams(), output_ids=[9])
    pages.attach(req, pages.no_match())
    req.cached_len = 6
    assert pages.reserve(req, 1 + 8)  # a 9-token verify row from position 6: pages up to position 14
    assert len(req.pages) == 4
    req.output_ids += [3, 4]  # two tokens committed beyond the first
    spec.roll_back(req)
    assert req.cached_len == req.total_len - 1 == 8
    assert len(req.pages) == 3  # positions 0..8 (the newest token's slot included)
    assert pages.allocator.num_free == 16 - 3


def test_verify_row_inputs_and_sampling_steps():
    req = Req(1, [1, 2], SamplingParams(), output_ids=[3, 4])
    other = Req(2, [1], SamplingParams(), output_ids=[5])
    assert verify_row(req, [6, 7]) == [4, 6, 7]
    assert verify_row(Req(3, [1, 2], SamplingParams()), [6]) == [2, 6]  # a fully cached prompt's last token
    assert row_steps([other, req, req, req, other]) == [1, 2, 3, 4, 1]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], start=2) == 3
    assert common_prefix([], [1]) == 0


def test_can_speculate():
    assert can_speculate(SamplingParams(temperature=0.7, top_k=5, min_tokens=2, logit_bias={3: 1.0}))
    for params in (SamplingParams(logprobs=2), SamplingParams(repetition_penalty=1.1),
                   SamplingParams(frequency_penalty=0.2)):  # fmt: skip
        assert not can_speculate(params)


class _Cuda:
    name = "cuda"

    def offline_prefill_tokens(self) -> int:
        return 8192


def test_config_checks_and_no_overlap():
    with pytest.raises(ValueError, match="speculative_algorithm"):
        SchedulerConfig(speculative_algorithm="medusa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SchedulerConfig(speculative_algorithm="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="go together"):
        SchedulerConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="n-gram"):
        SchedulerConfig(speculative_algorithm="ngram", speculative_ngram_min=4, speculative_ngram_max=3)
    assert resolve(SchedulerConfig(), _Cuda()).overlap is True
    assert resolve(SchedulerConfig(speculative_algorithm="ngram"), _Cuda()).overlap is False


def test_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-algorithm", "ngram", "--num-speculative-tokens", "6",
                              "--speculative-ngram-max", "4", "--speculative-ngram-min", "2"])  # fmt: skip
    assert check_engine_args(args) is None
    config = scheduler_config(args)
    assert (config.speculative_algorithm, config.num_speculative_tokens) == ("ngram", 6)
    assert (config.speculative_ngram_max, config.speculative_ngram_min) == (4, 2)
    assert "go together" in (check_engine_args(parser.parse_args(["--speculative-algorithm", "draft"])) or "")
    assert check_engine_args(parser.parse_args(["--num-speculative-tokens", "17"])) is not None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-algorithm", "eagle"])
