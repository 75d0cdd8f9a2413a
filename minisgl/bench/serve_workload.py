"""Workloads for the online benchmark: text prompts of a requested token length.

Token-id prompts are not portable across servers, so prompts are plain text: words drawn from a
fixed list with a seeded RNG, then trimmed or extended until a token counter (the server's
/tokenize or a local tokenizer) gives the requested length. The same seed and counter give the
same text, so two servers with the same tokenizer receive identical prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

TokenCounter = Callable[[str], int]

# Common words that are one token each in most BPE vocabularies, so a prompt of N words is close
# to N tokens and the calibration loop below usually converges in one or two counts.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is that for it as was with be by on not he this are or his from at which
    but have an they you were one all we their has been there had can more if will would so what
    when who some out them into time only new other these two may first then do any like my now
    over such our man me even most made after also did many before must through back years where
    much your way well down should because each just those people how too little state good very
    make world still own see men work long get here between both life being under never day same
    another know while last might us great old year off come since against go came right used take
    three place small found part house water number sound city river light word point mother young
    country school garden window paper music story table market family morning winter summer
    animal answer rain travel simple""".split()
)

_MAX_CALIBRATION_ROUNDS = 24


class BenchRequest(NamedTuple):
    prompt: str
    prompt_len: int  # as counted by the calibration counter
    output_len: int


@dataclass(frozen=True)
class WorkloadConfig:
    """`min_input`..`max_input` is the whole prompt length, or, with a shared prefix, the length
    of the distinct question that follows the `shared_prefix`-token system text."""

    num_requests: int
    min_input: int
    max_input: int
    output_len: int
    shared_prefix: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 1 <= self.min_input <= self.max_input:
            raise ValueError(f"need 1 <= min_input <= max_input, got {self.min_input}..{self.max_input}")
        if self.output_len < 1:
            raise ValueError("output_len must be >= 1")
        if self.shared_prefix < 0:
            raise ValueError("shared_prefix must be >= 0")


def make_text(rng: random.Random, count_tokens: TokenCounter, target_len: int) -> tuple[str, int]:
    """Random words whose token count is `target_len` (or the closest reachable count below it
    when a word boundary makes the exact length impossible). Returns the text and its count."""
    if target_len < 1:
        raise ValueError("target_len must be >= 1")
    words = [rng.choice(WORDS) for _ in range(target_len)]
    count = count_tokens(" ".join(words))
    for _ in range(_MAX_CALIBRATION_ROUNDS):
        if count == target_len:
            break
        if count < target_len:
            words.extend(rng.choice(WORDS) for _ in range(target_len - count))
        else:
            del words[-max(1, count - target_len):]
            if not words:
                words = [rng.choice(WORDS)]
        count = count_tokens(" ".join(words))
    # Still off (a multi-token word keeps overshooting): drop words until at or under target.
    while count > target_len and len(words) > 1:
        words.pop()
        count = count_tokens(" ".join(words))
    return " ".join(words), count


def build_workload(config: WorkloadConfig, count_tokens: TokenCounter) -> list[BenchRequest]:
    """Deterministic for a given config and counter. Lengths come from their own RNG so they do not
    depend on how many words calibration needed."""
    length_rng = random.Random(f"{config.seed}-lengths")
    text_rng = random.Random(f"{config.seed}-text")
    lengths = [length_rng.randint(config.min_input, config.max_input) for _ in range(config.num_requests)]
    if config.shared_prefix == 0:
        requests = []
        for length in lengths:
            text, count = make_text(text_rng, count_tokens, length)
            requests.append(BenchRequest(text, count, config.output_len))
        return requests
    prefix, prefix_len = make_text(text_rng, count_tokens, config.shared_prefix)
    requests = []
    for index, length in enumerate(lengths):
        # The question starts with a newline, which BPE pre-tokenizers split off, so the prefix
        # tokenizes identically in every prompt and a prefix cache can share it.
        head = f"{prefix}\n\nQuestion {index + 1}:"
        head_len = count_tokens(head)

        def question_len(text: str, head: str = head, head_len: int = head_len) -> int:
            return count_tokens(f"{head} {text}?") - head_len

        question, _ = make_text(text_rng, question_len, length)
        prompt = f"{head} {question}?"
        requests.append(BenchRequest(prompt, count_tokens(prompt), config.output_len))
    assert all(r.prompt.startswith(prefix) for r in requests) and prefix_len > 0
    return requests


def arrival_offsets(num_requests: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at once without a rate,
    otherwise a Poisson process with `request_rate` requests per second."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    rng = random.Random(f"{seed}-arrivals")
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


@dataclass(frozen=True)
class Preset:
    num_requests: int
    concurrency: int
    min_input: int
    max_input: int
    output_len: int
    shared_prefix: int = 0
    description: str = ""


PRESETS: dict[str, Preset] = {
    "W1": Preset(1, 1, 128, 128, 128, description="1 request, 128-token prompt, 128 output tokens"),
    "W2": Preset(32, 32, 64, 512, 128, description="32 concurrent, prompts 64-512 tokens, 128 output tokens"),
    "W3": Preset(32, 32, 16, 32, 64, shared_prefix=400,
                 description="32 concurrent, shared 400-token system text + 16-32-token questions, 64 output tokens"),
}
