"""`GET /metrics`: Prometheus text format (prometheus_client, one registry per app).

Names follow Prometheus conventions — counters end in `_total`, durations are `_seconds`
histograms, fractions are `_ratio` gauges — and docs/metrics.md maps each to vLLM's equivalent
(tests/unit/test_metric_names.py checks every exposed family's name and type against that table).
prometheus_client's `_created` companion series are switched off (as vLLM does): no dashboard
reads them and they would be a second family, a gauge, beside every counter and histogram.

Request timings are taken in the API server as replies arrive (`ReplyObserver`), so they include
tokenization and the hops between processes:
- time to first token: from the request's arrival to its first visible text (tokens whose text
  is still held back, e.g. a possible stop string, count when it is released);
- inter-token latency: the gap between two deltas, spread over the tokens of the later one;
- time per output token: first text to the last delta over the tokens after the first, per request;
- end-to-end latency: arrival to the final delta.
A choice of `n > 1` counts as a request. Queue sizes, KV usage (pages held by requests, not
counting evictable prefix-cache pages, over all pages) and the prefix cache (prompt tokens of
every admitted request, how many of them it held, and their ratio) come from scheduler rank 0 of
every replica at scrape time, summed; the `minisgl_replica_*` families give each replica's own
(label `replica`, also with a single replica), so `--dp` routing can be watched.

Admission control (admission.py) is read from its guard at scrape time: generation requests
admitted, turned away with 503 (overloaded or draining; never one refused for its API key, which
is a 401 before admission), ended at --request-timeout or by the end of a drain, and in flight.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from minisgl.message.frontend import ErrorMsg, StatsMsg, TextDelta
from minisgl.server.frontend import ServiceStats

if TYPE_CHECKING:
    from minisgl.server.admission import AdmissionGuard

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5e6 tokens

disable_created_metrics()


@dataclass(slots=True)
class _Timing:
    start: float
    first: float | None = None
    last: float | None = None


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model}
        r = self.registry
        self.requests = Counter("minisgl_requests", "Finished requests by finish reason",
                                ["model_name", "finish_reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens of finished requests",
                                         ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.ttft = Histogram("minisgl_time_to_first_token_seconds", "Arrival to first text",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.itl = Histogram("minisgl_inter_token_latency_seconds", "Time between output tokens",
                             ["model_name"], buckets=_TOKEN_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.e2e = Histogram("minisgl_e2e_request_latency_seconds", "Arrival to the last token",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.running = Gauge("minisgl_num_requests_running", "Requests being decoded",
                             ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.waiting = Gauge("minisgl_num_requests_waiting", "Requests waiting for admission",
                             ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.kv_usage = Gauge("minisgl_kv_cache_usage_ratio", "Fraction of KV pages held by requests",
                              ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.hit_ratio = Gauge("minisgl_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache, "
                               "over all prompt tokens", ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.tpot = Histogram("minisgl_request_time_per_output_token_seconds", "First text to the last token, "
                              "over the tokens after the first", ["model_name"], buckets=_TOKEN_BUCKETS,
                              registry=r).labels(**labels)  # fmt: skip
        self.request_prompt_tokens = Histogram("minisgl_request_prompt_tokens", "Prompt tokens of each finished "
                                               "request", ["model_name"], buckets=_COUNT_BUCKETS,
                                               registry=r).labels(**labels)  # fmt: skip
        self.request_generation_tokens = Histogram("minisgl_request_generation_tokens", "Generated tokens of each "
                                                   "finished request", ["model_name"], buckets=_COUNT_BUCKETS,
                                                   registry=r).labels(**labels)  # fmt: skip
        per_replica = ["model_name", "replica"]
        self.replica_running = Gauge("minisgl_replica_num_requests_running", "Requests each replica decodes",
                                     per_replica, registry=r)  # fmt: skip
        self.replica_waiting = Gauge("minisgl_replica_num_requests_waiting", "Requests waiting in each replica",
                                     per_replica, registry=r)  # fmt: skip
        self.replica_kv_usage = Gauge("minisgl_replica_kv_cache_usage_ratio", "Fraction of each replica's KV "
                                      "pages held by requests", per_replica, registry=r)  # fmt: skip
        self.spec_acceptance = Gauge("minisgl_spec_decode_acceptance_ratio", "Speculative decoding: proposed "
                                     "tokens accepted, over all proposed", ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.spec_length = Gauge("minisgl_spec_decode_mean_accepted_length", "Speculative decoding: tokens "
                                 "committed per verify step (accepted proposals + the model's own token)",
                                 ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.scheduler_counts = _SchedulerCountsCollector(model)
        r.register(self.scheduler_counts)
        self.model = model
        self._live: dict[int, _Timing] = {}

    # ------------------------------------------------------------------ ReplyObserver
    def opened(self, rids: list[int]) -> None:
        now = time.perf_counter()
        for rid in rids:
            self._live[rid] = _Timing(now)

    def reply(self, reply: TextDelta | ErrorMsg) -> None:
        now = time.perf_counter()
        if isinstance(reply, ErrorMsg):
            if self._live.pop(reply.rid, None) is not None:
                self.requests.labels(self.model, "error").inc()
            return
        timing = self._live.get(reply.rid)
        count = len(reply.token_ids)
        if timing is not None and (count or reply.text):
            if timing.last is None:
                self.ttft.observe(now - timing.start)
                timing.first = now
            elif count:
                gap = (now - timing.last) / count
                for _ in range(count):
                    self.itl.observe(gap)
            timing.last = now
        if reply.finish_reason is not None:
            self.requests.labels(self.model, reply.finish_reason).inc()
            self.prompt_tokens.inc(reply.prompt_tokens)
            self.generation_tokens.inc(reply.completion_tokens)
            self.request_prompt_tokens.observe(reply.prompt_tokens)
            self.request_generation_tokens.observe(reply.completion_tokens)
            if timing is not None:
                self.e2e.observe(now - timing.start)
                if timing.first is not None and reply.completion_tokens > 1:
                    self.tpot.observe((now - timing.first) / (reply.completion_tokens - 1))
                del self._live[reply.rid]

    def forget(self, rids: list[int]) -> None:
        for rid in rids:
            self._live.pop(rid, None)

    def track_admission(self, guard: AdmissionGuard) -> None:
        """Export the counters of the app's admission guard (once per registry)."""
        self.registry.register(_AdmissionCollector(self.model, guard))

    # ------------------------------------------------------------------ scrape
    def render(self, stats: ServiceStats | None) -> bytes:
        if stats is not None:
            total = stats.total
            self.running.set(total.running)
            self.waiting.set(total.waiting)
            self.kv_usage.set(_kv_usage(total))
            if total.prompt_tokens:
                self.hit_ratio.set(total.cached_tokens / total.prompt_tokens)
            if total.spec_draft_tokens:
                self.spec_acceptance.set(total.spec_accepted_tokens / total.spec_draft_tokens)
            if total.spec_verify_steps:
                self.spec_length.set(1 + total.spec_accepted_tokens / total.spec_verify_steps)
            self.scheduler_counts.stats = stats
            for i, replica in enumerate(stats.replicas):
                labels = (self.model, str(i))
                self.replica_running.labels(*labels).set(replica.running)
                self.replica_waiting.labels(*labels).set(replica.waiting)
                self.replica_kv_usage.labels(*labels).set(_kv_usage(replica))
        return generate_latest(self.registry)


def _kv_usage(stats: StatsMsg) -> float:
    held = stats.total_pages - stats.free_pages - stats.evictable_pages
    return max(0, held) / stats.total_pages if stats.total_pages else 0.0


class _SchedulerCountsCollector(Collector):
    """Counters the schedulers keep (prefix-cache tokens, requests each replica received and
    aborted), exported as counters from their last scrape-time answer; absent until one came."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: ServiceStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        total = self.stats.total
        for name, doc, value in (
            ("minisgl_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", total.prompt_tokens),
            ("minisgl_prefix_cache_hits", "Prompt tokens the prefix cache held", total.cached_tokens),
            ("minisgl_spec_decode_num_drafts", "Speculative verify steps (one per request and step)",
             total.spec_verify_steps),
            ("minisgl_spec_decode_num_draft_tokens", "Tokens proposed for verification", total.spec_draft_tokens),
            ("minisgl_spec_decode_num_accepted_tokens", "Proposed tokens the model accepted",
             total.spec_accepted_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
        requests = CounterMetricFamily("minisgl_replica_requests", "Requests each replica has received",
                                       labels=["model_name", "replica"])  # fmt: skip
        aborted = CounterMetricFamily("minisgl_replica_aborted_requests", "Requests each replica has aborted",
                                      labels=["model_name", "replica"])  # fmt: skip
        for i, replica in enumerate(self.stats.replicas):
            requests.add_metric([self.model, str(i)], replica.requests)
            aborted.add_metric([self.model, str(i)], replica.aborted)
        yield requests
        yield aborted


class _AdmissionCollector(Collector):
    """The guard's own counters, read when scraped (nothing to keep in step)."""

    def __init__(self, model: str, guard: AdmissionGuard) -> None:
        self.model = model
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        counts = self.guard.counts
        for name, doc, value in (
            ("minisgl_admitted_requests", "Generation requests admitted by the API server", counts.admitted),
            ("minisgl_rejected_requests", "Generation requests refused with 503: overloaded or draining",
             counts.rejected),
            ("minisgl_timed_out_requests", "Requests ended at --request-timeout", counts.timed_out),
            ("minisgl_drain_aborted_requests", "Requests still running when a drain ended", counts.drain_aborted),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
        gauge = GaugeMetricFamily("minisgl_num_requests_in_flight", "Generation requests admitted and not yet "
                                  "answered in full", labels=["model_name"])  # fmt: skip
        gauge.add_metric([self.model], self.guard.in_flight)
        yield gauge
