"""`store.shards`: two Envoys over three single-member etcd clusters, one shard each. Records
spread over all three (counted per etcd); a record stored through one Envoy replays through the
other; with one shard's etcd killed, its records get the store's `on_error` answer (503
store-unavailable, nothing forwarded) while the other shards' records replay and new keys homed
there execute; the failed calls are counted under the dead shard's label only, and the
dashboard's shard panels show them."""

from __future__ import annotations

import json

import pytest

import harness
from harness import assert_problem, key_headers, new_key
from idemkit import REPO_ROOT, promql
from idemkit.bootstrap import shipped_stats_config

BODY = b'{"item":"book","qty":1}'
PREFIX = "/e2e-shards/"
CLUSTERS = ["etcd-a", "etcd-b", "etcd-c"]
FILTER_CONFIG = {
    "store": {"type": "etcd", "prefix": PREFIX, "shards": [{"cluster": c} for c in CLUSTERS]},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "processing_timeout": "30s"}],
}
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "idempotency-dashboard.json"


@pytest.fixture(scope="module")
def shards():
    members = [harness.Etcd("shard-" + c).start() for c in CLUSTERS]
    yield members
    for m in members:
        m.stop()


@pytest.fixture(scope="module")
def fleet(envoy_bin, filter_wasm, upstream, shards):
    clusters = [harness.etcd_cluster([m.client_port], name=c) for c, m in zip(CLUSTERS, shards)]
    pair = [harness.Envoy(envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm, name=name,
                          extra_clusters=clusters,
                          stats_config=shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")).start()
            for name in ("shards-a", "shards-b")]
    yield pair
    for proxy in pair:
        proxy.stop()


def records(member) -> set[str]:
    return set(member.keys(PREFIX + "r/"))


# The shard each key of the first test was stored on (its index in CLUSTERS).
HOMES: dict[str, int] = {}


def test_records_spread_over_every_shard_and_replay_on_either_envoy(fleet, shards, upstream):
    for i in range(60):
        key = new_key()
        before = [records(m) for m in shards]
        first = fleet[i % 2].post("/orders", BODY, key_headers(key))
        assert first.status == 201 and not first.replayed, first
        grown = [i for i, m in enumerate(shards) if len(records(m) - before[i]) == 1]
        # On exactly one shard, and nothing written to the others.
        assert len(grown) == 1 and all(records(m) == before[j] for j, m in enumerate(shards) if j != grown[0])
        HOMES[key] = grown[0]
        again = fleet[(i + 1) % 2].post("/orders", BODY, key_headers(key))
        assert again.status == 201 and again.replayed and again.body == first.body
        assert upstream.executions(key) == 1
    per_shard = [list(HOMES.values()).count(s) for s in range(3)]
    # About a third each (60 keys: fewer than 5 on one shard happens once in 100,000 runs).
    assert all(n >= 5 for n in per_shard), per_shard
    assert [len(records(m)) for m in shards] == per_shard


def test_one_shard_down_answers_its_records_by_on_error_and_the_others_work(fleet, shards, upstream):
    assert HOMES, "runs after the spread test"
    dead = 2
    shards[dead].kill()
    for i, (key, home) in enumerate(HOMES.items()):
        resp = fleet[i % 2].post("/orders", BODY, key_headers(key))
        if home == dead:
            assert_problem(resp, 503, "store-unavailable")
        else:
            assert resp.status == 201 and resp.replayed, (key, home, resp)
        assert upstream.executions(key) == 1
    # New keys: those homed on the dead shard are refused and never executed; the rest execute.
    outcomes = []
    for i in range(30):
        key = new_key()
        resp = fleet[i % 2].post("/orders", BODY, key_headers(key))
        assert resp.status in (201, 503), resp
        assert upstream.executions(key) == (1 if resp.status == 201 else 0)
        outcomes.append(resp.status)
    assert outcomes.count(503) >= 2 and outcomes.count(201) >= 10, outcomes

    # Failed calls are counted under the dead shard only, on both Envoys.
    for proxy in fleet:
        series = promql.parse_scrape(proxy.prometheus()).get("idempotency_store_calls_failed_total", [])
        failed = {labels.get("shard"): value for labels, value in series}
        assert failed.get("etcd-c", 0) > 0 and failed.get("etcd-a") == 0 and failed.get("etcd-b") == 0, failed

    # The dashboard's shard panels name what such an Envoy exports, and show the dead shard.
    dash = json.loads(DASHBOARD.read_text())
    variables = {"shard": "etcd-a|etcd-b|etcd-c", "__rate_interval": "10m", "datasource": "prom"}
    targets = [(p["title"], t["expr"]) for p in dash["panels"] if p["title"].startswith("etcd shards")
               for t in p["targets"]]
    assert len(targets) == 2
    first = promql.parse_scrape(fleet[0].prometheus())
    fleet[0].post("/orders", BODY, key_headers(next(k for k, h in HOMES.items() if h == dead)))
    fleet[0].post("/orders", BODY, key_headers(next(k for k, h in HOMES.items() if h != dead)))
    scrape = promql.parse_scrape(fleet[0].prometheus())
    for title, expr in targets:
        assert not promql.check(expr, scrape, variables), (title, promql.check(expr, scrape, variables))
    history = [(0.0, first), (5.0, scrape)]
    failed = promql.evaluate(promql.parse(promql.substitute(targets[0][1], variables)), history, 1)
    rising = {dict(k).get("shard") for k, v in failed.items() if v > 0}
    assert rising == {"etcd-c"}, failed
