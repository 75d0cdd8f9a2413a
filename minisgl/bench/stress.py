"""Reliability stress test against a running server (loopback only).

    python -m minisgl.bench stress --url http://127.0.0.1:30000 --concurrency 300 \\
        --disconnects 100 --invalid 50 --rounds 3 --max-tokens 16

Each round starts everything at once: `concurrency` streaming requests (chat and text completions
in turn, `ignore_eos`, fixed `max_tokens`, usage in the stream), of which `disconnects` are cut at
a random point (while uploading, before the response, or after k events), plus `invalid` bad and
hostile requests of varied kinds (malformed, out of range, a 10 MB body, JSON nested 100k deep,
lone surrogates, negative token ids, 100k-token prompts, grammars beyond the compile limits).
Then it polls `/v1/internal/stats` until the server is idle (bounded) and reads the memory (RSS)
of every server process (the launcher / API server and each worker) through the pids `/health`
reports. With `--api-key`, every request carries the key.

Violations (exit status 1): a valid request that failed, got a 5xx or an error event, hung past
`--timeout`, or did not get exactly `max_tokens` tokens with finish_reason "length"; a bad request
answered with anything but a 4xx; a server not idle with every page free or evictable after the
round; API-server reply state left behind; a process whose RSS grew from the second round to the
last by more than `RSS_SLACK` (the first round warms caches and allocators up). The HTTP client is a small asyncio one, so a cut is a
real closed socket at exactly the chosen point (bench/rawhttp.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from minisgl.bench.rawhttp import Cut, HttpError, HttpReply, http_call

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
RSS_SLACK_MB, RSS_SLACK_RATIO = 48.0, 0.05  # growth allowed per process from round 2 to the last


# ---------------------------------------------------------------------------------------------
# The requests of one round


def valid_body(i: int, max_tokens: int, chat: bool) -> tuple[str, bytes]:
    common = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": i,
              "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        body = {**common, "messages": [{"role": "user", "content": f"Request {i}: count from {i % 97}."}]}
        return "/v1/chat/completions", json.dumps(body).encode()
    return "/v1/completions", json.dumps({**common, "prompt": f"{i % 89}, {i % 89 + 1},"}).encode()


_MSGS = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> tuple[str, str, bytes]:
    return "POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": _MSGS, **fields}).encode()


def _comp(**fields: Any) -> tuple[str, str, bytes]:
    return "POST", "/v1/completions", json.dumps({"model": "m", **fields}).encode()


# Requests a server must refuse with a 4xx: malformed bodies, wrong types and ranges, prompts the
# context cannot hold, token ids outside the vocabulary, unknown routes and methods.
INVALID: list[tuple[str, Callable[[], tuple[str, str, bytes]]]] = [
    ("malformed json", lambda: ("POST", "/v1/chat/completions", b'{"model": "m", "messages": [')),
    ("not an object", lambda: ("POST", "/v1/chat/completions", b"[1, 2, 3]")),
    ("empty body", lambda: ("POST", "/v1/completions", b"")),
    ("invalid utf-8", lambda: ("POST", "/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}')),
    ("missing messages", lambda: ("POST", "/v1/chat/completions", b'{"model": "m"}')),
    ("bad role", lambda: _chat(messages=[{"role": 7, "content": "x"}])),  # custom string roles are allowed
    ("max_tokens type", lambda: _chat(max_tokens="ten", stream=True)),
    ("negative max_tokens", lambda: _chat(max_tokens=-3)),
    ("max_tokens beyond context", lambda: _chat(max_tokens=10**7, stream=True)),
    ("huge max_tokens", lambda: _comp(prompt="x", max_tokens=2**70)),
    ("huge seed", lambda: _chat(seed=10**30)),
    ("n out of range", lambda: _chat(n=0)),
    ("negative temperature", lambda: _chat(temperature=-1)),
    ("unknown field", lambda: _chat(mystery=1)),
    ("token id out of vocab", lambda: _comp(prompt=[10**9], max_tokens=2)),
    ("empty prompt", lambda: _comp(prompt="", max_tokens=2)),
    ("prompt beyond context", lambda: _comp(prompt="word " * 9000, max_tokens=2)),
    ("generate without input", lambda: ("POST", "/generate", b'{"sampling_params": {}}')),
    ("unknown route", lambda: ("POST", "/v1/nope", b"{}")),
    ("wrong method", lambda: ("GET", "/v1/chat/completions", b"")),
    # hostile
    ("10 MB body", lambda: ("POST", "/v1/completions", b'{"model": "m", "prompt": "' + b"x" * 10**7 + b'"}')),
    ("nested 100k deep", lambda: ("POST", "/v1/chat/completions", b'{"messages": ' + b"[" * 10**5 + b"]" * 10**5 + b"}")),
    ("lone surrogate", lambda: ("POST", "/v1/completions", b'{"model": "m", "prompt": "a\\ud800", "max_tokens": 2}')),
    ("negative token id", lambda: _comp(prompt=[1, -7], max_tokens=2)),
    ("100k-token prompt", lambda: _comp(prompt=[100] * 100_000, max_tokens=2)),
    ("huge regex repeat", lambda: _chat(regex="[a-z]{1,100000}", max_tokens=2)),
    ("wide schema", lambda: _chat(max_tokens=2, response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}}})),
    ("circular schema", lambda: _chat(max_tokens=2, response_format={"type": "json_schema", "json_schema": {
        "name": "c", "schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}})),
]


# ---------------------------------------------------------------------------------------------
# Running rounds


@dataclass(frozen=True)
class StressConfig:
    host: str
    port: int
    concurrency: int = 300
    disconnects: int = 100
    invalid: int = 50
    rounds: int = 3
    max_tokens: int = 16
    seed: int = 0
    timeout: float = 120.0  # per request
    idle_timeout: float = 60.0  # waiting for the server to be idle after a round

    def __post_init__(self) -> None:
        if self.host not in LOOPBACK:
            raise ValueError(f"stress only targets this machine (127.0.0.1, ::1, localhost), not {self.host!r}")
        if not 0 <= self.disconnects <= self.concurrency:
            raise ValueError("--disconnects must be between 0 and --concurrency")
        if min(self.concurrency, self.rounds, self.max_tokens) < 1 or self.invalid < 0:
            raise ValueError("--concurrency, --rounds and --max-tokens must be >= 1, --invalid >= 0")


@dataclass
class RoundReport:
    round: int
    valid: int = 0
    completed: int = 0  # valid, uncut, exactly max_tokens tokens, finish "length", [DONE]
    cut: int = 0  # disconnected on purpose (ended wherever the cut fell)
    failed: int = 0
    server_errors: int = 0  # 5xx, among every request of the round
    hung: int = 0
    invalid: int = 0
    invalid_rejected: int = 0  # answered 4xx
    wall_s: float = 0.0
    idle_s: float | None = None  # after the last reply, until the server was idle (None: never)
    total_pages: int = 0
    free_pages: int = 0
    evictable_pages: int = 0
    live_requests: int = -1
    rss_mb: float = 0.0  # API server (launcher) process
    rss_total_mb: float = 0.0  # with every worker process
    rss_by_process: dict[str, float] = field(default_factory=dict)  # "api", "tokenizer", "scheduler-0", ...
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_stream(reply: HttpReply, max_tokens: int) -> str | None:
    """None if a valid stream delivered exactly `max_tokens` tokens, else what was wrong."""
    if reply.status != 200:
        return f"status {reply.status}: {reply.body[:200]!r}"
    if not reply.events or reply.events[-1] != "[DONE]":
        return f"stream did not end with [DONE] ({len(reply.events)} events)"
    usage, finish = None, None
    for payload in reply.events[:-1]:
        chunk = json.loads(payload)
        if "error" in chunk:
            return f"error event: {chunk['error'].get('message')}"
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            finish = choice.get("finish_reason") or finish
    if usage is None:
        return "no usage chunk"
    if usage.get("completion_tokens") != max_tokens:
        return f"{usage.get('completion_tokens')} tokens instead of {max_tokens}"
    if finish != "length":
        return f"finish_reason {finish!r} instead of 'length'"
    return None


async def _get_json(cfg: StressConfig, path: str) -> tuple[int, Any]:
    reply = await asyncio.wait_for(http_call(cfg.host, cfg.port, "GET", path), 30)
    return reply.status, json.loads(reply.body or b"null")


async def _one_valid(cfg: StressConfig, i: int, cut: Cut | None, rep: RoundReport) -> None:
    path, body = valid_body(i, cfg.max_tokens, chat=i % 2 == 0)
    try:
        reply = await asyncio.wait_for(http_call(cfg.host, cfg.port, "POST", path, body, cut=cut), cfg.timeout)
    except asyncio.TimeoutError:
        rep.hung += 1
        rep.problems.append(f"request {i} hung for {cfg.timeout:.0f} s")
        return
    except (HttpError, OSError) as exc:
        if cut is None:
            rep.failed += 1
            rep.problems.append(f"request {i}: {exc!r}")
        else:
            rep.cut += 1  # the cut fell where the server could not finish its answer
        return
    if reply.status >= 500:
        rep.server_errors += 1
        rep.problems.append(f"request {i}: {reply.status} {reply.body[:200]!r}")
        return
    if reply.cut:
        rep.cut += 1
        return
    wrong = _check_stream(reply, cfg.max_tokens)
    if wrong is None:
        rep.completed += 1
    else:
        rep.failed += 1
        rep.problems.append(f"request {i}: {wrong}")


async def _one_invalid(cfg: StressConfig, kind: str, make: Callable[[], tuple[str, str, bytes]],
                       rep: RoundReport) -> None:  # fmt: skip
    method, path, body = make()
    try:
        reply = await asyncio.wait_for(
            http_call(cfg.host, cfg.port, method, path, body if method == "POST" else None), cfg.timeout
        )
    except asyncio.TimeoutError:
        rep.hung += 1
        rep.problems.append(f"bad request '{kind}' hung for {cfg.timeout:.0f} s")
        return
    except (HttpError, OSError) as exc:
        rep.problems.append(f"bad request '{kind}': {exc!r}")
        return
    if 400 <= reply.status < 500:
        rep.invalid_rejected += 1
        return
    if reply.status >= 500:
        rep.server_errors += 1
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        detail = reply.events[:2]
    else:
        detail = reply.body[:200]  # type: ignore[assignment]
    rep.problems.append(f"bad request '{kind}' answered {reply.status}: {detail!r}")


def _plan_cuts(rng: random.Random, cfg: StressConfig) -> dict[int, Cut]:
    cuts: dict[int, Cut] = {}
    for i in rng.sample(range(cfg.concurrency), cfg.disconnects):
        roll = rng.random()
        if roll < 0.1:
            cuts[i] = Cut("upload", reset=rng.random() < 0.5)
        elif roll < 0.3:
            cuts[i] = Cut("response", reset=rng.random() < 0.5)
        else:  # somewhere in the stream (role chunk and token chunks)
            cuts[i] = Cut("events", events=rng.randint(1, cfg.max_tokens), reset=rng.random() < 0.5)
    return cuts


async def wait_idle(cfg: StressConfig, rep: RoundReport) -> None:
    """Poll the stats until nothing runs, waits or is live and every page is free or evictable."""
    start = time.monotonic()
    stats: dict[str, Any] = {}
    while time.monotonic() - start < cfg.idle_timeout:
        try:
            status, stats = await _get_json(cfg, "/v1/internal/stats")
        except (HttpError, OSError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            rep.problems.append(f"stats unavailable: {exc!r}")
            return
        if status == 200:
            rep.total_pages, rep.free_pages = stats["total_pages"], stats["free_pages"]
            rep.evictable_pages, rep.live_requests = stats["evictable_pages"], stats["live_requests"]
            idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["live_requests"] == 0
            if idle and rep.free_pages + rep.evictable_pages == rep.total_pages:
                rep.idle_s = time.monotonic() - start
                return
        await asyncio.sleep(0.25)
    rep.problems.append(f"server not idle with every page back {cfg.idle_timeout:.0f} s after the round: {stats}")


async def _memory(cfg: StressConfig, rep: RoundReport) -> None:
    try:
        import psutil
    except ImportError:
        return
    try:
        _, health = await _get_json(cfg, "/health")
        pids = {"api": int(health["pid"]), **{name: int(c["pid"]) for name, c in health["children"].items()}}
        for name, pid in pids.items():
            try:
                rep.rss_by_process[name] = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                rep.problems.append(f"the {name} process (pid {pid}) is gone")
        rep.rss_mb = rep.rss_by_process.get("api", 0.0)
        rep.rss_total_mb = sum(rep.rss_by_process.values())
    except (HttpError, OSError, KeyError, ValueError, asyncio.TimeoutError, psutil.Error) as exc:
        rep.problems.append(f"could not read the server's memory: {exc!r}")


def check_rss_flat(reports: list[RoundReport]) -> list[str]:
    """Processes whose RSS grew from the second round to the last beyond the slack."""
    if len(reports) < 3:
        return []
    base, last = reports[1].rss_by_process, reports[-1].rss_by_process
    grown = []
    for name, start in base.items():
        end = last.get(name, start)
        if end - start > max(RSS_SLACK_MB, RSS_SLACK_RATIO * start):
            grown.append(f"RSS of {name} grew from {start:.0f} MiB (round 1) to {end:.0f} MiB (round "
                         f"{reports[-1].round})")  # fmt: skip
    return grown


async def run_round(cfg: StressConfig, number: int, rng: random.Random) -> RoundReport:
    rep = RoundReport(number, valid=cfg.concurrency, invalid=cfg.invalid)
    cuts = _plan_cuts(rng, cfg)
    base = number * cfg.concurrency
    tasks = [_one_valid(cfg, base + i, cuts.get(i), rep) for i in range(cfg.concurrency)]
    for j in range(cfg.invalid):
        kind, make = INVALID[(j + number) % len(INVALID)]
        tasks.append(_one_invalid(cfg, kind, make, rep))
    rng.shuffle(tasks)
    start = time.monotonic()
    await asyncio.gather(*tasks)
    rep.wall_s = time.monotonic() - start
    await wait_idle(cfg, rep)
    await _memory(cfg, rep)
    return rep


async def run_stress(cfg: StressConfig, echo: Callable[[str], None] | None = None) -> list[RoundReport]:
    rng = random.Random(cfg.seed)
    reports = []
    for number in range(cfg.rounds):
        rep = await run_round(cfg, number, rng)
        reports.append(rep)
        if number == cfg.rounds - 1:
            rep.problems.extend(check_rss_flat(reports))
        if echo is not None:
            echo(format_round(rep))
    return reports


def format_round(rep: RoundReport) -> str:
    idle = "never" if rep.idle_s is None else f"{rep.idle_s:.1f} s"
    text = (f"round {rep.round}: {rep.completed}/{rep.valid - rep.cut} completed, {rep.cut} cut, "
            f"{rep.failed} failed, {rep.server_errors} 5xx, {rep.hung} hung, "
            f"{rep.invalid_rejected}/{rep.invalid} bad requests refused (4xx) | {rep.wall_s:.1f} s, "
            f"idle after {idle}: pages {rep.free_pages} free + {rep.evictable_pages} cached / {rep.total_pages}, "
            f"live {rep.live_requests} | RSS MiB: "
            + ", ".join(f"{name} {mb:.0f}" for name, mb in rep.rss_by_process.items())
            + f", all {rep.rss_total_mb:.0f}")  # fmt: skip
    for problem in rep.problems[:10]:
        text += f"\n  ! {problem}"
    if len(rep.problems) > 10:
        text += f"\n  ! ... and {len(rep.problems) - 10} more"
    return text


def parse_args(argv: list[str]) -> tuple[StressConfig, bool]:
    p = argparse.ArgumentParser(prog="python -m minisgl.bench stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, on this machine (http://127.0.0.1:PORT)")
    p.add_argument("--concurrency", type=int, default=300, help="valid streaming requests per round")
    p.add_argument("--disconnects", type=int, default=100, help="of those, cut at a random point")
    p.add_argument("--invalid", type=int, default=50, help="bad and hostile requests per round (varied kinds)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to wait for idle after a round")
    p.add_argument("--json", action="store_true", help="print the per-round reports as JSON")
    args = p.parse_args(argv)
    url = urlsplit(args.url)
    if url.scheme != "http" or url.hostname is None:
        p.error(f"expected --url http://127.0.0.1:PORT, got {args.url!r}")
    try:
        cfg = StressConfig(url.hostname, url.port or 80, args.concurrency, args.disconnects, args.invalid,
                           args.rounds, args.max_tokens, args.seed, args.timeout, args.idle_timeout)  # fmt: skip
    except ValueError as exc:
        p.error(str(exc))
    return cfg, args.json


def main(argv: list[str]) -> int:
    cfg, as_json = parse_args(argv)
    print(f"stress: {cfg.rounds} round(s) of {cfg.concurrency} streams ({cfg.disconnects} cut), "
          f"{cfg.invalid} bad requests, max_tokens {cfg.max_tokens}, against {cfg.host}:{cfg.port}", flush=True)  # fmt: skip
    reports = asyncio.run(run_stress(cfg, echo=None if as_json else lambda line: print(line, flush=True)))
    if as_json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in reports], indent=1))
    bad = [r for r in reports if not r.ok]
    total = sum(r.completed for r in reports)
    print(f"stress: {'FAILED' if bad else 'OK'}: {total} streams completed with exactly {cfg.max_tokens} tokens, "
          f"{sum(r.failed for r in reports)} failed, {sum(r.server_errors for r in reports)} 5xx, "
          f"{sum(r.hung for r in reports)} hung; {len(bad)} round(s) with violations", flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
