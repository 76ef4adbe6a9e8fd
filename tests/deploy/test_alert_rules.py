"""deploy/prometheus/alerts.yaml: the alerts the docs promise, each with a severity, a summary, a
description and a runbook link (the links themselves are checked by test_doc_links.py), and each
covered by deploy/prometheus/alerts-test.yaml both ways: a test case where it fires and one where
it stays silent. `make alerts-test` runs those cases with promtool (check rules, test rules);
tests/e2e/operations/test_alerts.py checks the rules against a live scrape of `make run`."""

from __future__ import annotations

import re

import yaml

from idemkit import REPO_ROOT, promql

RULES = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"
TESTS = REPO_ROOT / "deploy" / "prometheus" / "alerts-test.yaml"
OPERATIONS = REPO_ROOT / "docs" / "OPERATIONS.md"

# What issue 34 asked for, as the outcome (or the series) each alert reads.
EXPECTED = {
    "IdempotencyOutcomeUnknown": "outcome_unknown",
    "IdempotencySettlementAbandoned": "settlement_abandoned",
    "IdempotencyStoreErrors": "store_error",
    "IdempotencyStoreFillHigh": "claimed",
    "IdempotencyStoreFull": "store_full",
    "IdempotencyDetachedRefused": "detached_refused",
    "IdempotencyStoreBypassed": "store_bypassed",
    "IdempotencyReconcileFailing": "reconcile_failed",
    # Issue 45: a worker's counter of its own, not a request's outcome.
    "IdempotencyClaimLost": "idempotency_claims_lost_total",
}


def _rules() -> dict[str, dict]:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert all("alert" in r for r in rules), "recording rules belong elsewhere"
    return {r["alert"]: r for r in rules}


def _cases() -> list[dict]:
    return [case for test in yaml.safe_load(TESTS.read_text())["tests"] for case in test["alert_rule_test"]]


def test_the_alerts_the_docs_promise_are_there():
    assert set(_rules()) == set(EXPECTED)


def test_every_alert_reads_its_outcome_of_the_filters_counters():
    for name, rule in _rules().items():
        selectors, _ = promql.references(rule["expr"])
        if EXPECTED[name].startswith("idempotency_"):
            assert selectors and all(metric == EXPECTED[name] for metric, _ in selectors), (name, selectors)
            continue
        assert selectors and all(metric == "idempotency_requests_total" for metric, _ in selectors), (name, selectors)
        outcomes = {value for _, matchers in selectors for label, op, value in matchers if label == "outcome"}
        assert EXPECTED[name] in outcomes, (name, outcomes)


def test_every_alert_has_a_severity_a_summary_and_a_runbook():
    for name, rule in _rules().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        assert annotations["runbook_url"].startswith("docs/OPERATIONS.md#"), name


def test_every_alert_is_in_the_operations_table_and_has_its_runbook_section():
    text = OPERATIONS.read_text()
    for name, rule in _rules().items():
        assert re.search(r"^\| `%s` \|" % name, text, re.M), name
        section = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert re.search(r"^### %s$" % "".join(
            c for c in section if c.isalnum()), text, re.M | re.I), (name, section)


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_stays_silent():
    tests = yaml.safe_load(TESTS.read_text())
    assert tests["rule_files"] == ["alerts.yaml"]
    cases = _cases()
    for name, rule in _rules().items():
        mine = [c for c in cases if c["alertname"] == name]
        firing = [c for c in mine if c["exp_alerts"]]
        silent = [c for c in mine if not c["exp_alerts"]]
        assert firing and silent, (name, mine)
        for case in firing:
            for alert in case["exp_alerts"]:
                assert alert["exp_labels"]["severity"] == rule["labels"]["severity"], name
                assert alert["exp_annotations"]["runbook_url"] == rule["annotations"]["runbook_url"], name
    assert {c["alertname"] for c in cases} == set(_rules())
