"""C24 on etcd: the admin API of one Envoy settles records that another Envoy of the fleet left
with an unknown outcome. The admin instance reads etcd, so an operator may ask any Envoy: it
finds the record by its key, resolves it (every retry, on either Envoy, then replays the
answer and the upstream never executes it again) or releases it (its retry then executes,
once). The data plane's replay cache is on, as an operator would run it: an outcome-unknown
record is never kept there, so a settled record is seen at once. Two tenants that use one key,
each through another Envoy, own two records: any Envoy's list names each one's tenant, and
`tenant=` narrows it to one.
"""

from __future__ import annotations

import json
import time

import pytest

import harness
from harness import assert_problem, key_headers, new_key
from idemkit.bootstrap import admin_listener
from idemkit.client import request

BODY = b'{"order":7,"amount":"5.00"}'


def store() -> dict:
    return harness.etcd_store(prefix="/e2e-admin/", replay_cache={"entries": 100})


def start(envoy_bin, filter_wasm, upstream, etcd, name):
    config = {
        "store": store(),
        "tenant_header": "x-tenant-id",
        "routes": [{"name": "pay", "match": {"prefix": "/pay"}, "require_key": True, "processing_timeout": "3s"}],
    }
    return harness.Envoy(
        envoy_bin, upstream.port, config, wasm_path=filter_wasm, name=name, route_timeout="1s",
        extra_clusters=[harness.etcd_cluster([etcd.client_port])],
        extra_listeners=[admin_listener({"store": store(), "admin": {}}, filter_wasm)],
    ).start()


@pytest.fixture(scope="module")
def fleet(envoy_bin, filter_wasm, upstream, etcd):
    pair = [start(envoy_bin, filter_wasm, upstream, etcd, n) for n in ("admin-a", "admin-b")]
    yield pair
    for proxy in pair:
        proxy.stop()


def admin(envoy, method: str, path: str, body=None):
    return request(envoy.listener_ports["idempotency_admin"], method, path, body, {})


def unknown_outcome(envoy, operator) -> tuple[str, dict]:
    """A key whose first request on `envoy` outlived the route timeout, and its record as the
    admin API of `operator` lists it once its outcome is unknown. The worker writes that to etcd
    after the client's 504 has left, so the operator looks until it is there (a retry meanwhile
    gets 409, the record still in flight)."""
    key = new_key()
    first = envoy.post("/pay", BODY, key_headers(key, x_delay_ms="1500"))
    assert first.status == 504, first
    deadline = time.monotonic() + 5
    while not (records := listed(operator, key, "outcome_unknown")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["key"] for r in records] == [key], records
    assert_problem(envoy.post("/pay", BODY, key_headers(key)), 502, "outcome-unknown")
    return key, records[0]


def listed(envoy, key: str, state: str) -> list:
    resp = admin(envoy, "GET", "/idempotency/records?state=%s&key=%s" % (state, key))
    assert resp.status == 200, resp
    return json.loads(resp.body)["records"]


def find(envoy, key: str, state: str) -> dict:
    records = listed(envoy, key, state)
    assert [r["key"] for r in records] == [key], records
    return records[0]


def test_an_operator_on_one_envoy_resolves_a_record_the_other_left_unknown(fleet, upstream):
    a, b = fleet
    key, record = unknown_outcome(a, b)
    assert (record["route"], record["state"]) == ("pay", "outcome_unknown"), record
    answer = {"status": 201, "headers": [["content-type", "application/json"]], "body": '{"paid":true}'}
    settled = admin(b, "POST", "/idempotency/records/%s/resolve" % record["tag"], answer)
    assert settled.status == 200, settled
    for proxy in (a, b, a):
        retry = proxy.post("/pay", BODY, key_headers(key))
        assert (retry.status, retry.body, retry.replayed) == (201, b'{"paid":true}', True), retry
    assert upstream.executions(key) == 1
    assert find(a, key, "completed")["status"] == 201
    assert_problem(admin(a, "POST", "/idempotency/records/%s/resolve" % record["tag"], answer), 409,
                   "record-conflict")
    b.wait_counter(harness.STAT_PREFIX + "admin.resolved_total", 1)


def test_an_operator_releases_a_record_and_its_retry_executes_once(fleet, upstream):
    a, b = fleet
    key, record = unknown_outcome(a, b)
    # Its request may still be at work: refused until its claim's lease key is gone (twice the
    # 3 s lease and slack, by etcd's clock), as a takeover waits.
    early = admin(b, "POST", "/idempotency/records/%s/release" % record["tag"])
    assert_problem(early, 409, "record-conflict")
    deadline = time.monotonic() + 15
    while True:
        released = admin(b, "POST", "/idempotency/records/%s/release" % record["tag"])
        if released.status != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert released.status == 200, released
    retry = a.post("/pay", BODY, key_headers(key))
    assert retry.status == 201 and not retry.replayed, retry
    again = b.post("/pay", BODY, key_headers(key))
    assert (again.status, again.body, again.replayed) == (201, retry.body, True), again
    assert upstream.executions(key) == 2
    assert find(b, key, "all")["state"] == "completed"


def test_two_tenants_records_of_one_key_are_listed_each_with_its_tenant(fleet, upstream):
    a, b = fleet
    key = new_key()
    for proxy, tenant in ((a, "acme"), (b, "globex")):
        placed = proxy.post("/pay", BODY, key_headers(key, x_tenant_id=tenant))
        assert placed.status == 201 and not placed.replayed, placed
    assert upstream.executions(key) == 2
    for operator in (a, b):
        records = listed(operator, key, "all")
        assert sorted(r["tenant"] for r in records) == ["acme", "globex"], records
        assert {(r["method"], r["path"], r["state"]) for r in records} == {("POST", "/pay", "completed")}, records
        only = json.loads(admin(operator, "GET", "/idempotency/records?key=%s&tenant=globex" % key).body)
        assert [r["tenant"] for r in only["records"]] == ["globex"], only
