"""Prometheus names of `GET /metrics` (server/metrics.py): every family the registry exposes has
the name and type listed here and in docs/metrics.md (and nothing else is exposed), counters end
in `_total`, durations are `_seconds` histograms, fractions `_ratio` gauges, no `_created` series."""

from __future__ import annotations

import re
from pathlib import Path

from minisgl.message.frontend import ErrorMsg, StatsMsg, TextDelta
from minisgl.server.admission import AdmissionConfig, AdmissionGuard
from minisgl.server.frontend import ServiceStats
from minisgl.server.metrics import ServerMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
EXPECTED: dict[str, str] = {
    "minisgl_requests_total": "counter",
    "minisgl_prompt_tokens_total": "counter",
    "minisgl_generation_tokens_total": "counter",
    "minisgl_request_prompt_tokens": "histogram",
    "minisgl_request_generation_tokens": "histogram",
    "minisgl_time_to_first_token_seconds": "histogram",
    "minisgl_inter_token_latency_seconds": "histogram",
    "minisgl_request_time_per_output_token_seconds": "histogram",
    "minisgl_e2e_request_latency_seconds": "histogram",
    "minisgl_num_requests_running": "gauge",
    "minisgl_num_requests_waiting": "gauge",
    "minisgl_kv_cache_usage_ratio": "gauge",
    "minisgl_prefix_cache_queries_total": "counter",
    "minisgl_prefix_cache_hits_total": "counter",
    "minisgl_prefix_cache_hit_ratio": "gauge",
    "minisgl_admitted_requests_total": "counter",
    "minisgl_rejected_requests_total": "counter",
    "minisgl_timed_out_requests_total": "counter",
    "minisgl_drain_aborted_requests_total": "counter",
    "minisgl_num_requests_in_flight": "gauge",
    "minisgl_replica_requests_total": "counter",
    "minisgl_replica_aborted_requests_total": "counter",
    "minisgl_replica_num_requests_running": "gauge",
    "minisgl_replica_num_requests_waiting": "gauge",
    "minisgl_replica_kv_cache_usage_ratio": "gauge",
    "minisgl_spec_decode_num_drafts_total": "counter",
    "minisgl_spec_decode_num_draft_tokens_total": "counter",
    "minisgl_spec_decode_num_accepted_tokens_total": "counter",
    "minisgl_spec_decode_acceptance_ratio": "gauge",
    "minisgl_spec_decode_mean_accepted_length": "gauge",
}
_SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed_families(text: str) -> dict[str, str]:
    """`# TYPE` lines of a scrape, as Prometheus reads them: family name -> type."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def check_exposition(text: str) -> None:
    families = exposed_families(text)
    assert families == EXPECTED, {"missing": sorted(EXPECTED.keys() - families.keys()),
                                  "unexpected": sorted(families.keys() - EXPECTED.keys()),
                                  "wrong type": sorted(n for n in families if EXPECTED.get(n, families[n]) != families[n])}
    for name, kind in families.items():
        assert name.startswith("minisgl_") and not name.endswith("_created")
        if kind == "counter":
            assert name.endswith("_total")
        if kind == "histogram":
            assert name.endswith(("_seconds", "_tokens")), name
        if kind == "gauge" and ("usage" in name or "ratio" in name or "rate" in name):
            assert name.endswith("_ratio"), name
    for line in text.splitlines():  # every sample belongs to a declared family
        if line and not line.startswith("#"):
            sample = re.split(r"[{ ]", line, maxsplit=1)[0]
            assert any(sample == family + suffix for family, kind in families.items()
                       for suffix in _SUFFIXES[kind]), sample  # fmt: skip


def _stats(running: int, free: int) -> StatsMsg:
    return StatsMsg(query_id=0, total_pages=100, free_pages=free, cached_pages=0, evictable_pages=0, running=running,
                    waiting=1, prompt_tokens=40, cached_tokens=10, requests=3, aborted=1)  # fmt: skip


def scraped_metrics() -> str:
    metrics = ServerMetrics("m")
    metrics.track_admission(AdmissionGuard(lambda *_: None, AdmissionConfig()))  # type: ignore[arg-type]
    metrics.opened([1, 2])
    metrics.reply(TextDelta(1, "Hi", [5]))
    metrics.reply(TextDelta(1, " there", [6, 7]))
    metrics.reply(TextDelta(1, "!", [8], finish_reason="stop", prompt_tokens=12, completion_tokens=4))
    metrics.reply(ErrorMsg(2, "bad", 400))
    return metrics.render(ServiceStats([_stats(1, 90), _stats(2, 50)])).decode()


def test_exposed_names_and_types() -> None:
    check_exposition(scraped_metrics())


def test_values_under_the_new_names() -> None:
    text = scraped_metrics()
    for pattern in (
        r'^minisgl_requests_total\{finish_reason="stop",model_name="m"\} 1\.0$',
        r'^minisgl_requests_total\{finish_reason="error",model_name="m"\} 1\.0$',
        r'^minisgl_prefix_cache_queries_total\{model_name="m"\} 80\.0$',
        r'^minisgl_prefix_cache_hits_total\{model_name="m"\} 20\.0$',
        r'^minisgl_prefix_cache_hit_ratio\{model_name="m"\} 0\.25$',
        r'^minisgl_replica_aborted_requests_total\{model_name="m",replica="1"\} 1\.0$',
        r'^minisgl_request_prompt_tokens_sum\{model_name="m"\} 12\.0$',
        r'^minisgl_request_generation_tokens_bucket\{le="5\.0",model_name="m"\} 1\.0$',
        r'^minisgl_request_generation_tokens_bucket\{le="2\.0",model_name="m"\} 0\.0$',
        r'^minisgl_request_time_per_output_token_seconds_count\{model_name="m"\} 1\.0$',
        r'^minisgl_inter_token_latency_seconds_count\{model_name="m"\} 3\.0$',  # 2 + 1 tokens after the first
    ):  # fmt: skip
        assert re.search(pattern, text, re.M), pattern


def test_scheduler_counters_wait_for_a_scheduler_answer() -> None:
    """Before any stats answer there is no value to export for the scheduler's own counters
    (a counter must never go back, so none is made up)."""
    text = ServerMetrics("m").render(None).decode()
    families = exposed_families(text)
    assert "minisgl_prefix_cache_hits_total" not in families and "minisgl_replica_requests_total" not in families
    assert families["minisgl_requests_total"] == "counter"


def documented_families() -> dict[str, str]:
    rows = re.findall(r"^\| `(minisgl_\w+)` \| (\w+) \|", DOCS.read_text(), re.M)
    return dict(rows)


def test_docs_table_lists_every_family() -> None:
    assert documented_families() == EXPECTED
