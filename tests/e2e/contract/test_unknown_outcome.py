"""C16, C13, C20: `routes[].unknown_outcome`. When the outcome of a forwarded request cannot
be known (the route timeout passed, the client left while the upstream worked), a rule with
`"refuse"`, the default, completes the record at once as "outcome unknown": every retry with the
key, at once and after the lease, gets 502 `outcome-unknown` and the upstream never executes it
again. With `"takeover"` (for routes where a repeat is harmless) the record stays in flight (409)
until its lease ends and a retry then executes again. A detached call without an answer within
its `upstream_timeout` follows the same rule. Both stores: the local store and etcd (a real etcd
started here), whose completion the worker's root writes.
"""

from __future__ import annotations

import time

import pytest

import harness
from harness import assert_problem, build_request, key_headers, new_key

BODY = b'{"order":42,"amount":"19.99"}'
LEASE_S = 3
ROUTE_TIMEOUT = "1s"  # below the lease, as docs/CONFIGURATION.md asks
SLOW_MS = "3000"  # the upstream outlives the route timeout


def filter_config(store: dict) -> dict:
    rule = {"require_key": True, "processing_timeout": "%ds" % LEASE_S}
    return {
        "store": store,
        "routes": [
            dict(rule, name="pay", match={"prefix": "/pay"}, unknown_outcome="refuse"),
            dict(rule, name="orders", match={"prefix": "/orders"}, unknown_outcome="takeover"),
            dict(rule, name="charges", match={"prefix": "/charges"}),  # the default
            # What docs/CONTRACT.md recommends for payments: both (see Detached execution).
            dict(rule, name="dpay", match={"prefix": "/dpay"}, unknown_outcome="refuse",
                 execution="detached", upstream_timeout="2s"),
        ],
    }


FILTER_CONFIG = filter_config({"type": "local", "capacity": 1000})


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    with harness.envoy_on_store(request.param, "unknown", envoy_bin, filter_wasm, upstream, filter_config,
                                route_timeout=ROUTE_TIMEOUT) as proxy:
        yield proxy


def _counts(envoy) -> dict:
    """The counters these tests compare, from one read of /stats."""
    by_rule = envoy.outcomes_by_rule()
    outcomes = ("outcome_unknown", "unknown_refused", "kept_unknown")
    return {o: sum(v for (_, oc), v in by_rule.items() if oc == o) for o in outcomes} | {
        "%s.%s" % (rule, outcome): by_rule.get((rule, outcome), 0)
        for rule in ("pay", "dpay", "charges")
        for outcome in ("outcome_unknown", "unknown_refused")
    }


def _past_the_lease(since: float, extra: float = 0.5) -> None:
    remaining = since + LEASE_S + extra - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


def _assert_outcome_unknown(resp) -> None:
    doc = assert_problem(resp, 502, "outcome-unknown")
    assert "reconcile" in doc["detail"].lower() and "new Idempotency-Key" in doc["detail"], doc
    assert resp.header("retry-after") is None, resp


def _refused_at_once_and_after_the_lease(envoy, upstream, key, since, before, path="/pay"):
    # Counted once the store took the completion (etcd: the root wrote it).
    envoy.wait_counter("outcome_unknown", before["outcome_unknown"] + 1)
    _assert_outcome_unknown(envoy.post(path, BODY, key_headers(key)))
    # Another payload under the key: still the usual mismatch.
    other = envoy.post(path, b'{"order":42,"amount":"5.00"}', key_headers(key))
    assert_problem(other, 422, "payload-mismatch")
    # Past the point where the takeover test below executes again, on either store.
    _past_the_lease(since, extra=2.5)
    _assert_outcome_unknown(envoy.post(path, BODY, key_headers(key)))
    assert upstream.executions(key) == 1
    after = _counts(envoy)
    rule = path.strip("/")
    assert after["outcome_unknown"] == before["outcome_unknown"] + 1, after
    assert after[rule + ".outcome_unknown"] == before[rule + ".outcome_unknown"] + 1, after
    assert after["unknown_refused"] == before["unknown_refused"] + 2, after
    assert after[rule + ".unknown_refused"] == before[rule + ".unknown_refused"] + 2, after
    assert after["kept_unknown"] == before["kept_unknown"], after


def test_refuse_after_a_route_timeout(envoy, upstream):
    key = new_key()
    before = _counts(envoy)
    since = time.monotonic()
    first = envoy.post("/pay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504 and not first.replayed, first
    _refused_at_once_and_after_the_lease(envoy, upstream, key, since, before)


def test_refuse_after_the_client_left_while_the_upstream_worked(envoy, upstream):
    key = new_key()
    before = _counts(envoy)
    data = build_request("POST", "/pay", list(key_headers(key, x_delay_ms="800").items()), BODY)
    since = time.monotonic()
    harness.leave_while_upstream_works(envoy.port, upstream, key, data)
    envoy.wait_idle()
    _refused_at_once_and_after_the_lease(envoy, upstream, key, since, before)


def test_refuse_after_a_detached_call_got_no_answer(envoy, upstream):
    key = new_key()
    before = _counts(envoy)
    since = time.monotonic()
    first = envoy.post("/dpay", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    # The detached call's own answer for its client: 504 outcome-unknown at upstream_timeout.
    doc = assert_problem(first, 504, "outcome-unknown")
    assert "new Idempotency-Key" in doc["detail"], doc
    _refused_at_once_and_after_the_lease(envoy, upstream, key, since, before, path="/dpay")


def test_the_default_refuses_after_a_route_timeout(envoy, upstream):
    # The seed's double charge: a gateway timeout, then the client's retry after the lease
    # executed the payment again. By default now it never does.
    key = new_key()
    before = _counts(envoy)
    since = time.monotonic()
    first = envoy.post("/charges", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504 and not first.replayed, first
    _refused_at_once_and_after_the_lease(envoy, upstream, key, since, before, path="/charges")


def test_takeover_executes_again_after_the_lease(envoy, upstream):
    # The record waits for its lease (409), then a retry takes it over and executes again.
    key = new_key()
    kept, taken = envoy.idem("kept_unknown"), envoy.idem("taken_over")
    refused = envoy.idem("unknown_refused")
    since = time.monotonic()
    first = envoy.post("/orders", BODY, key_headers(key, x_delay_ms=SLOW_MS))
    assert first.status == 504, first
    envoy.wait_counter("kept_unknown", kept + 1)
    assert_problem(envoy.post("/orders", BODY, key_headers(key)), 409, "request-in-flight")
    _past_the_lease(since)
    # etcd ends a claim's lease by its own clock, in whole seconds: up to two more 409s.
    deadline = time.monotonic() + 5
    again = envoy.post("/orders", BODY, key_headers(key))
    while again.status == 409 and time.monotonic() < deadline:
        time.sleep(0.25)
        again = envoy.post("/orders", BODY, key_headers(key))
    assert again.status == 201 and not again.replayed, again
    envoy.wait_counter("taken_over", taken + 1)
    assert upstream.executions(key) == 2
    assert envoy.idem("unknown_refused") == refused
