"""Prometheus sees the filter's outcomes per route rule as labels of one family. The filter
counts each outcome under its rule (wasmcustom.idempotency.route.<rule>.requests_total.<outcome>),
and the stats tags of the shipped envoy/envoy.yaml, loaded from the file, turn that into
idempotency_requests_total{route="<rule>",outcome="<outcome>"} in /stats/prometheus: counters end
in _total, the outcome is a label, never part of a name (docs/OPERATIONS.md, Metrics)."""

from __future__ import annotations

import re

from harness import REPO_ROOT, new_key
from idemkit.bootstrap import shipped_stats_config

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True},
        # A dotted name: the tags must take it out whole.
        {"name": "payments.v2", "match": {"prefix": "/payments"}, "require_key": True},
    ],
}
ENVOY_OPTIONS = {"stats_config": shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")}

SERIES = re.compile(r"^idempotency_requests_total\{([^}]*)\} (\d+)$", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def labelled(text: str) -> dict[tuple[str, str], int]:
    """idempotency_requests_total series by (route, outcome); each must carry exactly those
    labels."""
    out = {}
    for labels, value in SERIES.findall(text):
        found = dict(LABEL.findall(labels))
        assert set(found) == {"route", "outcome"}, labels
        key = (found["route"], found["outcome"])
        assert key not in out, "two series for %s" % (key,)
        out[key] = int(value)
    return out


def test_first_call_replay_and_mismatch_are_separate_series_with_route_and_outcome(envoy, upstream):
    before = labelled(envoy.prometheus())
    key = new_key()
    headers = {"content-type": "application/json", "idempotency-key": key}
    assert envoy.post("/orders", b'{"qty":1}', headers).status == 201
    assert envoy.post("/orders", b'{"qty":1}', headers).replayed
    assert envoy.post("/orders", b'{"qty":2}', headers).status == 422
    assert envoy.post("/payments", b"{}", {"idempotency-key": new_key()}).status == 201
    envoy.wait_counter("stored", 2)

    text = envoy.prometheus()
    assert "# TYPE idempotency_requests_total counter" in text
    assert "wasmcustom" not in text
    # Every counter family ends in _total, and no family name carries an outcome; the gauges say
    # which module runs (test_build_info.py) and the unsettled records (test_unsettled.py).
    families = re.findall(r"^# TYPE (idempotency_\w+) (\w+)$", text, re.M)
    assert sorted(families) == [("idempotency_build_info", "gauge"),
                                ("idempotency_claims_lost_total", "counter"),
                                ("idempotency_claims_renewed_total", "counter"),
                                ("idempotency_records_swept_total", "counter"),
                                ("idempotency_requests_total", "counter"),
                                ("idempotency_store_watch_ended_total", "counter"),
                                ("idempotency_unknown_cluster_calls_total", "counter"),
                                ("idempotency_unmatched_requests_total", "counter"),
                                ("idempotency_unsettled_records", "gauge")], families
    after = labelled(text)
    for outcome in ("claimed", "replayed", "mismatch"):
        assert after[("orders", outcome)] == before.get(("orders", outcome), 0) + 1, outcome
        assert after[("payments.v2", outcome)] == before.get(("payments.v2", outcome), 0) + (
            outcome == "claimed"), outcome
    # The same counts as the rule's own counters in /stats; the total over every rule is
    # PromQL's sum by (outcome), here summed by hand.
    for outcome in ("claimed", "replayed", "mismatch"):
        assert envoy.route_counter("orders", outcome) == after[("orders", outcome)]
        total = sum(v for (_, o), v in after.items() if o == outcome)
        assert total == envoy.idem(outcome), outcome


def test_both_shipped_envoy_configs_and_the_operations_doc_carry_the_same_stats_tags():
    tags = shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")
    assert [t["tag_name"] for t in tags["stats_tags"]] == ["route", "outcome", "state", "version", "revision", "shard"]
    assert shipped_stats_config(REPO_ROOT / "envoy" / "envoy-etcd.yaml") == tags
    # docs/OPERATIONS.md, Metrics: the block users copy into their bootstrap (it was in README.md
    # before the README moved its details to docs/).
    assert shipped_stats_config(REPO_ROOT / "docs" / "OPERATIONS.md") == tags
