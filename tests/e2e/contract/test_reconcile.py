"""C23: `routes[].reconcile`. An unknown outcome (the route timeout passed while the upstream
worked, the upstream reset after reading the request, a detached call past `upstream_timeout`)
is kept in flight until its lease ends: a retry meanwhile gets 409 with `retry-after`. After the
lease the upstream's own lookup decides, asked by the first retry: a final 2xx is the outcome
(replayed to that retry and every later one, with `idempotent-reconciled: true`, and no second
lookup), a 404 lets the retry execute (one execution that committed, in all), and anything else
settles nothing (503 `outcome-unknown` with `retry-after`, the next retry asks again). A
different payload under the key is refused before any lookup. A key nobody retries is looked up
by the Envoy that saw its unknown outcome, a moment after the lease; a waiter (wait mode) is held
until then and gets the replay. Both stores: the local store and
etcd (a real etcd started here).
"""

from __future__ import annotations

import json
import time

import pytest

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

BODY = b'{"order":42,"amount":"19.99"}'
LEASE_S = 3
ROUTE_TIMEOUT = "1s"  # below the lease
SLOW_MS = "1500"  # the upstream outlives the route timeout, and commits within the lease
LOOKUP = {"path": "/_lookup/{key}"}


def filter_config(store: dict) -> dict:
    rule = {"require_key": True, "processing_timeout": "%ds" % LEASE_S, "reconcile": LOOKUP}
    return {
        "store": store,
        "routes": [
            dict(rule, name="pay", match={"prefix": "/pay"}),
            dict(rule, name="waitpay", match={"prefix": "/waitpay"}, concurrent="wait", wait_timeout="10s"),
            harness.detached_rule("dpay", "/dpay", LEASE_S, 1, reconcile=LOOKUP),
        ],
    }


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    with harness.envoy_on_store(request.param, "reconcile", envoy_bin, filter_wasm, upstream, filter_config,
                                route_timeout=ROUTE_TIMEOUT) as proxy:
        yield proxy


def _after_the_lease(envoy, since: float, path: str, key: str, through_unsettled: bool = True):
    """The first retry past the lease that is not 409 (etcd ends a claim's lease by its own
    clock, a few seconds late) and, with `through_unsettled`, not a 503 `outcome-unknown` either
    (the Envoy's own lookup at the lease's end may be under way: a client retries after
    `retry-after`)."""
    remaining = since + LEASE_S + 0.3 - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
    deadline = time.monotonic() + 8
    while True:
        resp = envoy.post(path, BODY, key_headers(key))
        unsettled = resp.status == 503 and through_unsettled
        if resp.status != 409 and not unsettled or time.monotonic() > deadline:
            return resp
        time.sleep(retry_after_seconds(resp) if unsettled else 0.25)


def _assert_reconciled_replay(resp, upstream, key) -> None:
    """`resp` is the committed answer of the key's one execution, replayed from the lookup."""
    assert resp.status == 201 and resp.replayed, resp
    assert resp.header("idempotent-reconciled") == "true", resp
    (execution,) = upstream.requests(key)
    assert json.loads(resp.body)["order_id"] == execution["n"], resp
    assert resp.header("content-type") == "application/json", resp


def _in_flight_during_the_lease(envoy, path: str, key: str) -> None:
    resp = envoy.post(path, BODY, key_headers(key))
    assert_problem(resp, 409, "request-in-flight")
    assert 1 <= retry_after_seconds(resp) <= LEASE_S, resp


def test_a_route_timeout_then_the_lookup_finds_the_answer(envoy, upstream):
    key = new_key()
    found, unknown = envoy.idem("reconciled_found"), envoy.idem("outcome_unknown")
    since = time.monotonic()
    first = envoy.post("/pay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504 and not first.replayed, first
    envoy.wait_counter("outcome_unknown", unknown + 1)
    _in_flight_during_the_lease(envoy, "/pay", key)
    # Another payload: refused before any lookup.
    other = envoy.post("/pay", b'{"order":42,"amount":"5.00"}', key_headers(key))
    assert_problem(other, 422, "payload-mismatch")
    assert upstream.lookups(key) == 0
    retry = _after_the_lease(envoy, since, "/pay", key)
    _assert_reconciled_replay(retry, upstream, key)
    envoy.wait_counter("reconciled_found", found + 1)
    # Every later retry replays the record: no second lookup, no second execution.
    lookups = upstream.lookups(key)
    again = envoy.post("/pay", BODY, key_headers(key))
    _assert_reconciled_replay(again, upstream, key)
    assert again.body == retry.body
    assert (upstream.lookups(key), upstream.executions(key)) == (lookups, 1)


def test_a_reset_before_the_upstream_committed_executes_after_the_lookup(envoy, upstream):
    key = new_key()
    not_found = envoy.idem("reconciled_not_found")
    since = time.monotonic()
    first = envoy.post("/pay", BODY, key_headers(key, x_reset="before-headers"))
    assert first.status == 503 and not first.replayed, first
    _in_flight_during_the_lease(envoy, "/pay", key)
    retry = _after_the_lease(envoy, since, "/pay", key)
    # The upstream read the request and dropped it uncommitted: the lookup's 404 lets the retry
    # execute, once.
    assert retry.status == 201 and not retry.replayed, retry
    assert retry.header("idempotent-reconciled") is None, retry
    envoy.wait_counter("reconciled_not_found", not_found + 1)
    again = envoy.post("/pay", BODY, key_headers(key))
    assert again.status == 201 and again.replayed and again.body == retry.body, again
    assert (upstream.executions(key), upstream.committed(key)) == (2, 1)


def test_with_no_retry_the_envoy_that_saw_it_looks_it_up_when_the_lease_ends(envoy, upstream):
    key = new_key()
    found = envoy.idem("reconciled_found")
    first = envoy.post("/pay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504, first
    # Nobody retries: the Envoy asks on its own, a moment after the lease.
    envoy.wait_counter("reconciled_found", found + 1, timeout=LEASE_S + 10)
    assert upstream.lookups(key) == 1
    retry = envoy.post("/pay", BODY, key_headers(key))
    _assert_reconciled_replay(retry, upstream, key)
    assert (upstream.lookups(key), upstream.executions(key)) == (1, 1)


def test_a_waiter_is_held_until_the_lookup_settles_the_record(envoy, upstream):
    key = new_key()
    since = time.monotonic()
    first = envoy.post("/waitpay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504, first
    # Held through the lease and past it, until the Envoy's own lookup settles the record.
    waiter = envoy.post("/waitpay", BODY, key_headers(key), timeout=15)
    _assert_reconciled_replay(waiter, upstream, key)
    assert time.monotonic() - since >= LEASE_S, "answered before the lease ended"
    assert upstream.executions(key) == 1


def test_a_failing_lookup_settles_nothing_until_it_recovers(envoy, upstream):
    key = new_key()
    failed = envoy.idem("reconcile_failed")
    since = time.monotonic()
    first = envoy.post("/pay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504, first
    upstream.fail_lookups(1000, status=500)
    retry = _after_the_lease(envoy, since, "/pay", key, through_unsettled=False)
    doc = assert_problem(retry, 503, "outcome-unknown")
    assert "same Idempotency-Key" in doc["detail"], doc
    wait_s = retry_after_seconds(retry)
    envoy.wait_counter("reconcile_failed", failed + 1)
    assert upstream.lookups(key) >= 1 and upstream.executions(key) == 1
    # The lookup recovers: the next retry after retry-after gets the answer.
    upstream.fail_lookups(0)
    time.sleep(wait_s)
    _assert_reconciled_replay(_after_the_lease(envoy, since, "/pay", key), upstream, key)
    assert upstream.executions(key) == 1


def test_a_detached_call_past_its_upstream_timeout_is_reconciled(envoy, upstream):
    key = new_key()
    since = time.monotonic()
    first = envoy.post("/dpay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    doc = assert_problem(first, 504, "outcome-unknown")
    assert "asked what happened" in doc["detail"], doc
    # How long its retries get 409: the lease, and on etcd the lease again (the claim's
    # completion's retry window, which its lease key outlives).
    in_flight_s = LEASE_S * (2 if envoy.name.endswith("-etcd") else 1)
    assert "until its claim ends, %d s after the request came" % in_flight_s in doc["detail"], doc
    _in_flight_during_the_lease(envoy, "/dpay", key)
    retry = _after_the_lease(envoy, since, "/dpay", key)
    _assert_reconciled_replay(retry, upstream, key)
    assert upstream.executions(key) == 1
