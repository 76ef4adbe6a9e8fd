"""The filter's counters in /stats and /stats/prometheus without stats tags (docs/OPERATIONS.md,
Metrics; no contract row: a promise to the operator), and its build-info gauge there."""

from __future__ import annotations

import re

import harness
from harness import (CLAIMS_LOST_STAT, CLAIMS_RENEWED_STAT, REPO_ROOT, ROUTE_STAT, STAT_PREFIX, SWEPT_STAT,
                     UNKNOWN_CLUSTER_STAT, UNMATCHED_STAT,
                     WATCH_ENDED_STAT, new_key)
from idemkit import module_revision, module_version

VERSION = module_version()
REVISION = module_revision()
# The build-info gauge (test_build_info.py): a gauge, not a counter, and the one other stat.
BUILD_INFO = "build_info.version.%s.revision.%s" % (VERSION, REVISION)

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}


def test_all_counters_exist_from_the_start(envoy):
    counters = set(envoy.filter_counters())
    expected = {(ROUTE_STAT % ("orders", o))[len(STAT_PREFIX):] for o in harness.OUTCOMES}
    expected |= {s[len(STAT_PREFIX):] for s in (UNMATCHED_STAT, SWEPT_STAT, WATCH_ENDED_STAT, UNKNOWN_CLUSTER_STAT,
                                                 CLAIMS_RENEWED_STAT, CLAIMS_LOST_STAT)}
    assert expected <= counters, sorted(expected - counters)
    # One family per meaning: no all-routes counter that repeats the rules' outcomes.
    per_rule = re.compile(r"route\.orders\.requests_total\.[a-z_]+")
    others = {c for c in counters - expected if not per_rule.fullmatch(c)}
    # Besides, the gauges: which module runs, and the rule's unsettled records (by state).
    unsettled = {"route.orders.unsettled_records.%s" % s for s in ("outcome_unknown", "processing")}
    assert others == {BUILD_INFO} | unsettled, sorted(others)


def test_counters_count_and_prometheus_names(envoy, upstream):
    key = new_key()
    before = envoy.outcomes()
    unmatched = envoy.counter(UNMATCHED_STAT)
    headers = {"content-type": "application/json", "idempotency-key": key}
    assert envoy.post("/orders", b"{}", headers).status == 201
    assert envoy.post("/orders", b"{}", headers).replayed
    assert envoy.post("/elsewhere", b"{}").status == 201
    envoy.wait_counter("stored", before["stored"] + 1)
    after = envoy.outcomes()
    assert after["claimed"] == before["claimed"] + 1
    assert after["replayed"] == before["replayed"] + 1
    assert after["passed_through"] == before["passed_through"] + 1
    assert after["mismatch"] == before["mismatch"]
    assert envoy.counter(UNMATCHED_STAT) == unmatched + 1
    assert envoy.route_counter("orders", "passed_through") == 0

    # Without stats tags (a bootstrap that lacks envoy/envoy.yaml's), the rule and the outcome
    # stay in the name; Envoy drops `wasmcustom.` and turns dots into underscores, nothing else.
    text = envoy.prometheus()
    m = re.search(r"^idempotency_route_orders_requests_total_replayed(?:\{\})? (\d+)$", text, re.M)
    assert m, [l for l in text.splitlines() if "idempotency" in l]
    assert int(m.group(1)) == after["replayed"]
    assert re.search(r"^idempotency_unmatched_requests_total(?:\{\})? %d$" % (unmatched + 1), text, re.M)
    assert re.search(r"^idempotency_records_swept_total(?:\{\})? 0$", text, re.M)
    assert re.search(r"^idempotency_store_watch_ended_total(?:\{\})? 0$", text, re.M)
    assert re.search(r"^idempotency_unknown_cluster_calls_total(?:\{\})? 0$", text, re.M)
    assert re.search(r"^idempotency_claims_renewed_total(?:\{\})? 0$", text, re.M)
    assert re.search(r"^idempotency_claims_lost_total(?:\{\})? 0$", text, re.M)
    # The version and the revision in the name, its dots made underscores, as a gauge.
    # Envoy's Prometheus names keep letters, digits and _ (0.3.0-dev: 0_3_0_dev).
    gauge = "idempotency_build_info_version_%s_revision_%s" % (re.sub(r"[^A-Za-z0-9]", "_", VERSION), REVISION)
    assert re.search(r"^# TYPE %s gauge$" % gauge, text, re.M)
    assert re.search(r"^%s(?:\{\})? 1$" % gauge, text, re.M)
    assert "wasmcustom" not in text
