"""The shipped alerting rules (deploy/prometheus/alerts.yaml) ask Prometheus only for what the
filter exports, as `make run` serves it, and fire on it.

The demo is started the way `make run` starts it (`python -m demo.run --envoy BIN`:
envoy/envoy.yaml, its stats tags, its three rules). Every rule's PromQL, read simply (metric
names, label matchers, `by` labels, the outcome values it asks for), is checked against the
demo's /stats/prometheus, as test_dashboard.py checks the dashboard's (idemkit.promql). Then a
charge whose route gives up while the upstream works (an unknown outcome: README step 6's first
call) is scraped again, and the two scrapes are handed to Prometheus' own rule engine
(`promtool test rules`) as series: IdempotencyOutcomeUnknown fires for route charges, with its
summary, and so does IdempotencyUnsettledRecords (its record waits in flight for the lookup:
`processing`), and no other alert fires. The rules' own unit tests are
deploy/prometheus/alerts-test.yaml (make alerts-test).

Needs ports 8080, 10000 and 9901 free, as test_demo.py does, and promtool (`make promtool`)."""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest
import yaml

from harness import REPO_ROOT, Demo, new_key, request, wait_until
from idemkit import promql

FILTER_CONFIG = None  # the demo runs envoy/envoy.yaml, not the harness's Envoy
RULES = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"
ENVOY_PORT, ADMIN_PORT = 10000, 9901


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _scrape() -> str:
    return request(ADMIN_PORT, "GET", "/stats/prometheus").body.decode()


def _value(scrape: dict, metric: str, **labels: str) -> float:
    return sum(v for ls, v in scrape.get(metric, []) if all(ls.get(k) == w for k, w in labels.items()))


def _series(scrapes: list[dict]) -> list[dict]:
    """promtool's input_series: every idempotency_* series, one value a minute per scrape, each
    held for 3 minutes (so rate and increase see the step)."""
    names = sorted({(m, tuple(sorted(ls.items()))) for s in scrapes for m, series in s.items()
                    if m.startswith("idempotency_") for ls, _ in series})
    out = []
    for metric, labels in names:
        values = []
        for s in scrapes:
            v = _value(s, metric, **dict(labels))
            values += ["%g" % v] * 3
        selector = ",".join('%s="%s"' % (k, v) for k, v in labels)
        out.append({"series": "%s{%s}" % (metric, selector) if selector else metric,
                    "values": " ".join(values)})
    return out


def test_every_rule_names_only_what_make_run_exports(envoy_bin):
    demo = Demo(envoy_bin)
    try:
        scrape = promql.parse_scrape(_scrape())
    finally:
        demo.stop(signal.SIGINT, group=False)
    rules = _rules()
    assert len(rules) >= 8 and all(r["expr"].strip() for r in rules), rules
    problems = {r["alert"]: found for r in rules if (found := promql.check(r["expr"], scrape, {}))}
    assert not problems, problems
    # The checker does catch a wrong outcome, label or name.
    assert promql.check('sum by (route) (increase(idempotency_requests_total{outcome="unknown_outcome"}[10m])) > 0',
                        scrape, {})
    assert promql.check('sum by (rule) (increase(idempotency_requests_total{outcome="store_error"}[5m])) > 0',
                        scrape, {})
    assert promql.check('sum(increase(idempotency_requests{outcome="store_error"}[5m])) > 0', scrape, {})


def test_an_unknown_outcome_in_make_run_fires_its_alert_in_prometheus(envoy_bin, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found (`make promtool` installs Debian's prometheus)", pytrace=False)
    demo = Demo(envoy_bin)
    try:
        before = promql.parse_scrape(_scrape())
        # The charges route waits 1 s; the upstream takes 2 s: Envoy's 504, outcome unknown.
        headers = {"idempotency-key": new_key(), "content-type": "application/json", "x-delay-ms": "2000"}
        assert request(ENVOY_PORT, "POST", "/charges", b'{"amount":7}', headers).status == 504

        def unknown(scrape: dict) -> float:
            return _value(scrape, "idempotency_requests_total", route="charges", outcome="outcome_unknown")

        wait_until(lambda: unknown(promql.parse_scrape(_scrape())) > unknown(before), 10, 0.2,
                   "outcome_unknown on route charges")
        after = promql.parse_scrape(_scrape())
    finally:
        demo.stop(signal.SIGINT, group=False)

    rules = {r["alert"]: r for r in _rules()}
    fired = rules["IdempotencyOutcomeUnknown"]
    # The charges rule reconciles: its record waits in flight for the lookup, and the unsettled
    # records gauge says so for as long as it does.
    unsettled = rules["IdempotencyUnsettledRecords"]
    tests = [{
        "interval": "1m",
        "input_series": _series([before, after]),
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": name, "exp_alerts": []} for name in rules
        ] + [
            {"eval_time": "5m", "alertname": name, "exp_alerts": []}
            for name in rules if name not in (fired["alert"], unsettled["alert"])
        ] + [{
            "eval_time": "5m",
            "alertname": unsettled["alert"],
            "exp_alerts": [{
                "exp_labels": dict(unsettled["labels"], route="charges", state="processing"),
                "exp_annotations": dict(
                    unsettled["annotations"], summary="Route charges: 1 record(s) processing for over a minute"),
            }],
        }] + [{
            "eval_time": "5m",
            "alertname": fired["alert"],
            "exp_alerts": [{
                "exp_labels": dict(fired["labels"], route="charges"),
                "exp_annotations": dict(
                    fired["annotations"],
                    summary="Route charges: 1 request(s) with an unknown outcome in the last 10 minutes"),
            }],
        }],
    }]
    test_file = tmp_path / "make-run-alerts-test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m",
                                         "tests": tests}, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
