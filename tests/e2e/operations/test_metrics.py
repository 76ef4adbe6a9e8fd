"""The filter's counters in /stats and /stats/prometheus (docs/OPERATIONS.md, Metrics; no contract
row: a promise to the operator)."""

from __future__ import annotations

import re

import harness
from harness import new_key

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}


def test_all_counters_exist_from_the_start(envoy):
    counters = envoy.filter_counters()
    expected = {"requests." + o for o in harness.OUTCOMES} | {"records.swept"}
    assert expected <= set(counters), sorted(expected - set(counters))


def test_counters_count_and_prometheus_names(envoy, upstream):
    key = new_key()
    before = envoy.filter_counters()
    headers = {"content-type": "application/json", "idempotency-key": key}
    assert envoy.post("/orders", b"{}", headers).status == 201
    assert envoy.post("/orders", b"{}", headers).replayed
    assert envoy.post("/elsewhere", b"{}").status == 201
    envoy.wait_counter("stored", before["requests.stored"] + 1)
    after = envoy.filter_counters()
    assert after["requests.claimed"] == before["requests.claimed"] + 1
    assert after["requests.replayed"] == before["requests.replayed"] + 1
    assert after["requests.passed_through"] == before["requests.passed_through"] + 1
    assert after["requests.mismatch"] == before["requests.mismatch"]

    text = envoy.prometheus()
    m = re.search(r"^idempotency_requests_replayed(?:\{[^}]*\})? (\d+)$", text, re.M)
    assert m, [l for l in text.splitlines() if "idempotency" in l]
    assert int(m.group(1)) == after["requests.replayed"]
    assert "wasmcustom" not in text
