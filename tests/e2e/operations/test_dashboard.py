"""The shipped Grafana dashboard (deploy/grafana/idempotency-dashboard.json) asks
Prometheus only for what the filter exports. A real Envoy with the shipped stats tags
(envoy/envoy.yaml) and the filter takes requests through the outcomes the panels show; then
every panel's PromQL, read simply (metric names, label matchers, `by` labels, the outcome values
it asks for), is checked against /stats/prometheus, and evaluated over two scrapes
(idemkit.promql, the evaluator deploy/grafana/render.py draws the README picture with)."""

from __future__ import annotations

import json
import threading
import time

from harness import REPO_ROOT, new_key
from idemkit import promql
from idemkit.bootstrap import shipped_stats_config

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "idempotency-dashboard.json"
FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True},
        {"name": "payments", "match": {"prefix": "/payments"}, "require_key": True,
         "concurrent": "wait", "wait_timeout": "5s"},
    ],
}
ENVOY_OPTIONS = {"stats_config": shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")}
# Grafana's variables as a user would set them (the route variable's "All" is `.*`).
VARIABLES = {"route": ".*", "__rate_interval": "1m", "ttl": "24h", "capacity": "1000", "datasource": "prom"}


# The etcd store's panels, whose series a local store never exports: tests/e2e/etcd/test_etcd_shards.py
# checks and evaluates them against Envoys on three etcd clusters.
ETCD_PANELS = "etcd shards"


def _targets(etcd: bool = False):
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]
            if p["title"].startswith(ETCD_PANELS) == etcd]


def _duplicate_while_running(envoy, path: str) -> int:
    """A slow original and, while it runs, its duplicate: the duplicate's status."""
    headers = {"idempotency-key": new_key(), "content-type": "application/json"}
    slow = threading.Thread(target=envoy.post, args=(path, b"{}", dict(headers, **{"x-delay-ms": "1500"})))
    slow.start()
    time.sleep(0.4)
    status = envoy.post(path, b"{}", headers).status
    slow.join()
    return status


def test_every_panel_names_only_what_the_filter_exports(envoy, upstream):
    first = promql.parse_scrape(envoy.prometheus())
    t0 = time.monotonic()
    headers = {"idempotency-key": new_key(), "content-type": "application/json"}
    assert envoy.post("/orders", b'{"qty":1}', headers).status == 201
    assert envoy.post("/orders", b'{"qty":1}', headers).replayed
    assert envoy.post("/orders", b'{"qty":2}', headers).status == 422
    assert envoy.post("/elsewhere", b"{}").status == 201
    assert _duplicate_while_running(envoy, "/orders") == 409
    assert _duplicate_while_running(envoy, "/payments") == 201  # held, then the replay
    envoy.wait_counter("waiting", 1)
    scrape = promql.parse_scrape(envoy.prometheus())

    # The panels' metrics and labels exist, and each outcome a panel asks for is a series.
    problems = {}
    for title, expr in _targets() + [("route variable", "idempotency_requests_total{route=~\".*\"}")]:
        found = promql.check(expr, scrape, VARIABLES)
        if found:
            problems[title + ": " + expr] = found
    assert not problems, json.dumps(problems, indent=1)
    # The checker does catch a wrong name, label or outcome.
    assert promql.check('sum by (route) (rate(idempotency_requests{outcome="replayed"}[1m]))', scrape, VARIABLES)
    assert promql.check('sum(rate(idempotency_requests_total{rule="orders"}[1m]))', scrape, VARIABLES)
    assert promql.check('sum(rate(idempotency_requests_total{outcome=~"replayed|replay"}[1m]))', scrape, VARIABLES)

    # Evaluated over the two scrapes (a window that spans them), the panels show the traffic.
    history = [(0.0, first), (time.monotonic() - t0, scrape)]
    values = {}
    for title, expr in _targets():
        node = promql.parse(promql.substitute(expr, dict(VARIABLES, __rate_interval="10m", ttl="10m")))
        values[(title, expr)] = promql.evaluate(node, history, 1)

    def series(title: str) -> dict:
        """The panel's non-zero series, over all its targets."""
        out = {}
        for (t, _), vec in values.items():
            if t == title:
                out.update({tuple(sorted(k)): v for k, v in vec.items() if v})
        return out

    outcomes = series("Outcomes per route")
    for route, outcome in [("orders", "claimed"), ("orders", "replayed"), ("orders", "mismatch"),
                           ("orders", "in_flight"), ("payments", "waiting"), ("payments", "replayed")]:
        assert ((("outcome", outcome), ("route", route))) in outcomes, (route, outcome, outcomes)
    share = series("Replay share per route")
    assert 0 < share[(("route", "orders"),)] < 1, share
    waits = series("Wait mode")
    assert set(waits) == {(("outcome", "in_flight"), ("route", "orders")),
                          (("outcome", "waiting"), ("route", "payments"))}, waits
    fill = series("Store fill (estimate)")
    assert list(fill.values()) and 0 < list(fill.values())[0] <= 1, fill
