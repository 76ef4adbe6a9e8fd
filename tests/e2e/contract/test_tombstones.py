"""C29: a tombstone after the ttl (`routes[].tombstone_ttl`), on a real Envoy.

A rule with `ttl: 2s` and `tombstone_ttl: 60s`: the upstream answers 201; a retry within the
ttl replays it; a retry at 3 s, when the response is no longer kept, gets 410 `result-expired`
with `idempotent-original-status: 201`; another payload under the key is still 422; the
upstream executed once. A rule without `tombstone_ttl` executes the retry again, as before.

On both stores: the local store keeps tombstones in a room of their own, etcd as one small key
on its own lease. Fails on a build before `tombstone_ttl`, which refuses the field (Envoy does
not start)."""

from __future__ import annotations

import json
import time

import pytest

import harness
from harness import assert_problem, new_key

TTL_S = 2


def filter_config(store: dict) -> dict:
    return {"store": store, "routes": ROUTES}


ROUTES = [
    {"name": "pay", "match": {"prefix": "/pay", "methods": ["POST"]}, "ttl": "%ds" % TTL_S,
     "processing_timeout": "1s", "tombstone_ttl": "60s"},
    {"name": "plain", "match": {"prefix": "/plain", "methods": ["POST"]}, "ttl": "%ds" % TTL_S,
     "processing_timeout": "1s"},
]


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    with harness.envoy_on_store(request.param, "tombstones", envoy_bin, filter_wasm, upstream, filter_config) as proxy:
        yield proxy


JSON = {"content-type": "application/json"}


def test_a_retry_after_the_ttl_gets_410_with_the_original_status_and_never_executes(envoy, upstream):
    key = new_key()
    headers = dict(JSON, **{"idempotency-key": key})
    body = json.dumps({"amount": 5}).encode()
    counted = envoy.idem("result_expired")
    first = envoy.post("/pay", body, headers)
    assert first.status == 201 and not first.replayed, first
    again = envoy.post("/pay", body, headers)
    assert again.replayed and again.body == first.body, again
    time.sleep(TTL_S + 1)
    expired = assert_problem(envoy.post("/pay", body, headers), 410, "result-expired")
    assert "201" in expired["detail"], expired
    late = envoy.post("/pay", body, headers)
    assert late.status == 410 and late.header("idempotent-original-status") == "201", late
    assert_problem(envoy.post("/pay", json.dumps({"amount": 6}).encode(), headers), 422, "payload-mismatch")
    assert upstream.executions(key) == 1
    envoy.wait_counter("result_expired", counted + 2)


def test_a_rule_without_tombstones_forgets_its_record_at_the_ttl(envoy, upstream):
    key = new_key()
    headers = dict(JSON, **{"idempotency-key": key})
    first = envoy.post("/plain", b"{}", headers)
    assert first.status == 201 and not first.replayed, first
    time.sleep(TTL_S + 1)
    later = envoy.post("/plain", b"{}", headers)
    assert later.status == 201 and not later.replayed, later
    assert upstream.executions(key) == 2
