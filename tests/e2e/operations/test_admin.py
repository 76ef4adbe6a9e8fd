"""C24, C25: the admin API. An operator lists the records whose outcome is unknown, finds one by its
key, settles it with the upstream's real answer (every retry then replays it, and the upstream
never executes it again), and releases another (its retry then executes). The admin instance is
the same module, vm_id and root_id on its own listener, as envoy/envoy.yaml ships it, so it
reads the data plane's records in the local store; a token that does not match gets 401, and a
configuration with both `admin` and `routes` does not start. A resolve whose answer would
split or misframe its replays (a CR, LF or NUL in a header value, a body on 204 or 304) is
refused with 400 naming what is wrong, and the record stays as it was. Two tenants that use one
key own two records: the list names each one's tenant, host, method, path and caller, and
`tenant=` narrows it to one, so the operator settles the right customer's.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

import harness
from harness import assert_problem, key_headers, new_key
from idemkit.bootstrap import admin_listener
from idemkit.client import request

BODY = b'{"order":42,"amount":"19.99"}'
TOKEN = "e2e-admin-token"
STORE = {"type": "local", "capacity": 1000}
FILTER_CONFIG = {
    "store": STORE,
    "tenant_header": "x-tenant-id",
    "routes": [{"name": "pay", "match": {"prefix": "/pay"}, "require_key": True, "processing_timeout": "3s"}],
}
ADMIN_CONFIG = {"store": STORE, "admin": {"token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}}


@pytest.fixture(scope="module")
def envoy(envoy_bin, filter_wasm, upstream):
    proxy = harness.Envoy(envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm, name="admin",
                          route_timeout="1s", extra_listeners=[admin_listener(ADMIN_CONFIG, filter_wasm)])
    yield proxy.start()
    proxy.stop()


def admin(envoy, method: str, path: str, body=None, token: str | None = TOKEN):
    headers = {"authorization": "Bearer " + token} if token is not None else {}
    return request(envoy.listener_ports["idempotency_admin"], method, path, body, headers)


def unknown_outcome(envoy, upstream) -> str:
    """A key whose first request outlived the route timeout: its outcome is unknown."""
    key = new_key()
    first = envoy.post("/pay", BODY, key_headers(key, x_delay_ms="1500"))
    assert first.status == 504, first
    envoy.wait_counter("outcome_unknown", 1)
    assert_problem(envoy.post("/pay", BODY, key_headers(key)), 502, "outcome-unknown")
    return key


def find(envoy, key: str) -> dict:
    listed = admin(envoy, "GET", "/idempotency/records?state=outcome_unknown&route=pay")
    assert listed.status == 200, listed
    found = [r for r in json.loads(listed.body)["records"] if r["key"] == key]
    assert len(found) == 1, listed.body
    return found[0]


def test_an_operator_resolves_an_unknown_outcome_and_every_retry_replays_it(envoy, upstream):
    key = unknown_outcome(envoy, upstream)
    record = find(envoy, key)
    assert record["route"] == "pay" and record["state"] == "outcome_unknown", record
    assert record["created_at"].endswith("Z") and record["expires_at"] > record["created_at"], record
    # The upstream committed it (its own log says so): the operator settles the record with that.
    answer = {"status": 201, "headers": [["content-type", "application/json"]], "body": '{"paid":true}'}
    settled = admin(envoy, "POST", "/idempotency/records/%s/resolve" % record["tag"], answer)
    assert settled.status == 200, settled
    for _ in range(2):
        retry = envoy.post("/pay", BODY, key_headers(key))
        assert (retry.status, retry.body, retry.replayed) == (201, b'{"paid":true}', True), retry
    assert upstream.executions(key) == 1
    # The record now shows its stored response; resolving it again is refused.
    shown = admin(envoy, "GET", "/idempotency/records/" + record["tag"])
    doc = json.loads(shown.body)
    assert (doc["state"], doc["status"], doc["response"]["body_bytes"]) == ("completed", 201, 13), doc
    again = admin(envoy, "POST", "/idempotency/records/%s/resolve" % record["tag"], answer)
    assert_problem(again, 409, "record-conflict")
    assert envoy.counter(harness.STAT_PREFIX + "admin.resolved_total") == 1
    # The audit line: the action, the record's tag, route and tenant, and the token by a prefix
    # of its SHA-256 (never of the token).
    token = "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest()[:8]
    line = 'admin resolved tag=%s route="pay" tenant="" token=%s (POST /idempotency/records/%s/resolve -> 200)'
    assert line % (record["tag"], token, record["tag"]) in envoy.log_text()
    assert TOKEN[:6] not in envoy.log_text()


def release_once_its_request_is_over(envoy, tag: str, within_s: float):
    """The first release of `tag` that is not refused as live (409 `record-conflict` while the
    request may still be at work), asked every 0.25 s: the answer, and how long it was refused."""
    since = time.monotonic()
    while True:
        resp = admin(envoy, "POST", "/idempotency/records/%s/release" % tag)
        if resp.status != 409 or time.monotonic() - since > within_s:
            return resp, time.monotonic() - since
        time.sleep(0.25)


def test_an_operator_releases_an_unknown_outcome_once_its_request_is_over_and_the_retry_executes(envoy, upstream):
    key = unknown_outcome(envoy, upstream)
    record = find(envoy, key)
    # Moments after the route's timeout its upstream may still be at work (it is: 1.5 s against
    # a 1 s route timeout): a release now would let the retry execute beside it. Refused, and
    # the detail says until when.
    early = admin(envoy, "POST", "/idempotency/records/%s/release" % record["id"])
    doc = assert_problem(early, 409, "record-conflict")
    assert "at work" in doc["detail"] and "at the earliest" in doc["detail"], doc
    assert_problem(admin(envoy, "POST", "/idempotency/records/%s/release?force=true" % record["id"]), 409,
                   "record-conflict")
    # Once the claim's lease (3 s) has ended: released, and the retry executes.
    released, waited = release_once_its_request_is_over(envoy, record["id"], within_s=5)
    assert released.status == 200 and waited > 0.5, (released, waited)
    retry = envoy.post("/pay", BODY, key_headers(key))
    assert retry.status == 201 and not retry.replayed, retry
    assert upstream.executions(key) == 2
    # A known outcome is released only with force.
    done = find_completed(envoy, key)
    assert_problem(admin(envoy, "POST", "/idempotency/records/%s/release" % done["tag"]), 409, "record-conflict")


@pytest.mark.parametrize("answer, names", [
    ({"status": 201, "headers": [["x-split", "1\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0"]]}, "x-split"),
    ({"status": 201, "headers": [["x-lf", "1\nset-cookie: session=stolen"]]}, "x-lf"),
    ({"status": 201, "headers": [["x-nul", "a\u0000b"]]}, "x-nul"),
    ({"status": 204, "body": "not allowed"}, "204"),
    ({"status": 304, "body_base64": "eA=="}, "304"),
])
def test_a_resolve_that_would_split_or_misframe_the_replay_is_refused(envoy, upstream, answer, names):
    key = unknown_outcome(envoy, upstream)
    record = find(envoy, key)
    refused = admin(envoy, "POST", "/idempotency/records/%s/resolve" % record["tag"], answer)
    assert names in assert_problem(refused, 400, "admin-bad-request")["detail"], refused
    # Nothing was written: the record is still unsettled, and a retry is still refused.
    shown = json.loads(admin(envoy, "GET", "/idempotency/records/" + record["tag"]).body)
    assert shown["state"] == "outcome_unknown" and "response" not in shown, shown
    retry = envoy.post("/pay", BODY, key_headers(key))
    assert_problem(retry, 502, "outcome-unknown")
    assert retry.header("x-split") is None and retry.header("set-cookie") is None, retry
    assert upstream.executions(key) == 1


def test_two_tenants_with_one_key_are_two_records_each_listed_with_its_scope(envoy, upstream):
    key = new_key()
    for tenant in ("acme", "globex"):
        placed = envoy.post("/pay", BODY, key_headers(key, x_tenant_id=tenant))
        assert placed.status == 201 and not placed.replayed, placed
    assert upstream.executions(key) == 2
    listed = admin(envoy, "GET", "/idempotency/records?key=" + key)
    records = json.loads(listed.body)["records"]
    assert sorted(r["tenant"] for r in records) == ["acme", "globex"], listed.body
    for r in records:
        assert (r["route"], r["key"], r["method"], r["path"]) == ("pay", key, "POST", "/pay"), r
        assert r["host"] and len(r["principal"]) == 8, r
    # The operator picks the customer's record: by tenant (and host), then by its tag.
    acme = admin(envoy, "GET", "/idempotency/records?key=%s&tenant=acme&host=%s" % (key, records[0]["host"]))
    only = json.loads(acme.body)["records"]
    assert [r["tenant"] for r in only] == ["acme"], acme.body
    assert only[0]["tag"] == [r["tag"] for r in records if r["tenant"] == "acme"][0]
    assert json.loads(admin(envoy, "GET", "/idempotency/records?tenant=initech&key=" + key).body)["records"] == []


def find_completed(envoy, key: str) -> dict:
    listed = admin(envoy, "GET", "/idempotency/records?state=completed&limit=1000")
    found = [r for r in json.loads(listed.body)["records"] if r["key"] == key]
    assert len(found) == 1, listed.body
    return found[0]


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_token_that_does_not_match_gets_401(envoy, token):
    resp = admin(envoy, "GET", "/idempotency/records", token=token)
    assert_problem(resp, 401, "admin-unauthorized")
    assert resp.header("www-authenticate") == "Bearer", resp
    envoy.wait_counter(harness.STAT_PREFIX + "admin.unauthorized_total", 1)


def test_a_configuration_with_both_admin_and_routes_does_not_start(envoy_bin, filter_wasm, upstream):
    both = dict(FILTER_CONFIG, admin={})
    proxy = harness.Envoy(envoy_bin, upstream.port, both, wasm_path=filter_wasm, name="admin-and-routes")
    with pytest.raises(harness.EnvoyStartError) as failed:
        proxy.start(timeout=10)
    assert "field `admin`: an admin instance protects no routes" in str(failed.value)
