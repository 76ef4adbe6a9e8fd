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
    # Issue 47: burn rates of new keys refused, and the module's own presence and version.
    "IdempotencyNewKeysFailingFast": "store_error|store_full|detached_refused",
    "IdempotencyNewKeysFailingSlow": "store_error|store_full|detached_refused",
    "IdempotencyMetricsAbsent": "idempotency_build_info",
    "IdempotencyVersionSkew": "idempotency_build_info",
    # The unsettled records gauge: while one stays unsettled, not a window after it appeared.
    "IdempotencyUnsettledRecords": "idempotency_unsettled_records",
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


# ---- for the Prometheus Operator (issue 47) ------------------------------------------------

PROMETHEUS_RULE = REPO_ROOT / "deploy" / "prometheus" / "prometheusrule.yaml"
POD_MONITOR = REPO_ROOT / "deploy" / "prometheus" / "podmonitor.yaml"
# The Prometheus Operator's duration pattern (its CRDs' `for`, `interval`, `scrapeTimeout`).
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")


def _string_map(value, where: str) -> None:
    assert isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()), where


def prometheus_rule_problems(doc: dict) -> list[str]:
    """What the PrometheusRule CRD (monitoring.coreos.com/v1) refuses in `doc`, for the fields it
    defines: spec required; each group a name (non-empty); each rule an expr (string or
    integer), at most one of alert and record, `for` a duration, labels and annotations maps of
    strings; group names unique (a list-map keyed by name)."""
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != ("monitoring.coreos.com/v1", "PrometheusRule"):
        problems.append("not a monitoring.coreos.com/v1 PrometheusRule")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems + ["spec: required"]
    names = [g.get("name") for g in spec.get("groups", [])]
    if len(names) != len(set(names)):
        problems.append("groups: names must be unique")
    for g in spec.get("groups", []):
        if not isinstance(g.get("name"), str) or not g["name"]:
            problems.append("group without a name")
        for r in g.get("rules", []):
            if not isinstance(r.get("expr"), (str, int)):
                problems.append("rule without expr: %s" % r)
            if ("alert" in r) == ("record" in r):
                problems.append("a rule is an alert or a record: %s" % r)
            if "for" in r and not (isinstance(r["for"], str) and DURATION.match(r["for"])):
                problems.append("for: %r" % r["for"])
            for field in ("labels", "annotations"):
                try:
                    _string_map(r.get(field, {}), field)
                except AssertionError:
                    problems.append("%s: not a map of strings in %s" % (field, r.get("alert")))
    return problems


def pod_monitor_problems(doc: dict) -> list[str]:
    """What the PodMonitor CRD refuses in `doc`, for the fields used: spec.selector required,
    each endpoint's port a string, path a string, interval a duration."""
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != ("monitoring.coreos.com/v1", "PodMonitor"):
        problems.append("not a monitoring.coreos.com/v1 PodMonitor")
    spec = doc.get("spec") or {}
    if not isinstance(spec.get("selector"), dict):
        problems.append("spec.selector: required")
    for e in spec.get("podMetricsEndpoints", []):
        if not isinstance(e.get("port"), str) or not isinstance(e.get("path", ""), str):
            problems.append("endpoint port and path are strings: %s" % e)
        if "interval" in e and not DURATION.match(e["interval"]):
            problems.append("interval: %r" % e["interval"])
    return problems


def test_the_prometheus_rule_holds_the_shipped_alerts():
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert prometheus_rule_problems(doc) == []
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"], \
        "prometheusrule.yaml is not alerts.yaml: run python3 deploy/prometheus/operator_manifests.py"


def test_the_pod_monitor_scrapes_the_sidecars_the_istio_manifests_select():
    doc = yaml.safe_load(POD_MONITOR.read_text())
    assert pod_monitor_problems(doc) == []
    istio = yaml.safe_load((REPO_ROOT / "istio" / "mesh" / "envoyfilter.yaml").read_text())
    assert doc["spec"]["selector"]["matchLabels"] == istio["spec"]["workloadSelector"]["labels"]
    [endpoint] = doc["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http-envoy-prom", "/stats/prometheus")


def test_the_schema_checks_refuse_what_the_crds_refuse():
    """The checks themselves: a rule without expr, a `for` that is no duration, an alert that is
    also a record, a PodMonitor without a selector."""
    good = yaml.safe_load(PROMETHEUS_RULE.read_text())
    for breaks in ({"for": "ten minutes"}, {"record": "x"}, {"expr": None}, {"labels": {"severity": 1}}):
        doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
        doc["spec"]["groups"][0]["rules"][0].update(breaks)
        assert prometheus_rule_problems(doc), breaks
    assert prometheus_rule_problems(good) == []
    monitor = yaml.safe_load(POD_MONITOR.read_text())
    del monitor["spec"]["selector"]
    assert pod_monitor_problems(monitor)
