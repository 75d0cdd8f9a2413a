"""`GET /metrics` of the running server: every family's name and type as docs/metrics.md lists
them (the same check as tests/unit/test_metric_names.py, on a real scrape after a request)."""

from __future__ import annotations

from typing import Any

from tests.e2e.service import Server, request
from tests.unit.test_metric_names import EXPECTED, check_exposition, exposed_families


def test_scraped_families_follow_the_table(server: Server, client: Any) -> None:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    status, raw = request(server.port, "GET", "/metrics")
    assert status == 200
    text = raw.decode()
    check_exposition(text)
    assert exposed_families(text) == EXPECTED
    # The families a dashboard ported from vLLM reads first have samples, not only a TYPE line.
    for sample in ("minisgl_requests_total{", "minisgl_time_to_first_token_seconds_count{",
                   "minisgl_prefix_cache_queries_total{", "minisgl_replica_requests_total{"):  # fmt: skip
        assert f"\n{sample}" in text, sample
