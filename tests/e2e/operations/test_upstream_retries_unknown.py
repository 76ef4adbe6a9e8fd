"""C26: an earlier attempt that was sent is never "never sent".

A route `retry_policy` (`retry_on: reset,connect-failure`, `num_retries: 2`; the docs advise
against it on protected routes, and Istio adds one by default) in front of an upstream host that
dies mid-request (`DyingUpstream`): it reads the request (one execution), then resets the
connection and stops listening, so Envoy's retries fail to connect. The router's last reason is
`remote_connection_failure` (flag UF), a reason that alone proves the request never left; but its
attempt count is 3, and the first attempt was sent. Before issue 45 the claim was released on
that last reason, and the client's retry executed the request again. Now the outcome is
unknown: on a `refuse` rule the retry gets 502 `outcome-unknown`, on a `takeover` rule 409
(kept in flight until its lease ends); the upstream executed once. A request that Envoy tried
only once and that never connected is still released (`/unreachable`, no retry policy).
concurrency 1: one worker, one store.
"""

from __future__ import annotations

import pytest

import harness
from harness import assert_problem, key_headers, new_key

RETRY_POLICY = {"retry_on": "reset,connect-failure", "num_retries": 2}

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "dying-pay", "match": {"prefix": "/dying-pay"}, "require_key": True},
        {"name": "dying-orders", "match": {"prefix": "/dying-orders"}, "require_key": True,
         "unknown_outcome": "takeover", "processing_timeout": "30s"},
        {"name": "never-sent", "match": {"prefix": "/unreachable"}, "require_key": True},
    ],
}

BODY = b'{"amount":4200,"currency":"EUR"}'


@pytest.fixture(scope="module")
def dying():
    host = harness.DyingUpstream()
    yield host
    host.close()


@pytest.fixture(scope="module")
def envoy(envoy_bin, filter_wasm, upstream, dying):
    proxy = harness.Envoy(
        envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm,
        name="upstream_retries_unknown", concurrency=1,
        extra_clusters=[harness.cluster("dying", dying.port)],
        extra_routes=[harness.route(prefix, cluster="dying", retry_policy=RETRY_POLICY)
                      for prefix in ("/dying-pay", "/dying-orders")],
    ).start()
    yield proxy
    proxy.stop()


def _executed_then_refused(envoy, dying, path, key):
    """The first request: executed by the dying host, then Envoy's retries are refused."""
    before = dying.executions
    retried = envoy.idem("upstream_retried")
    dying.arm()
    first = envoy.post(path, BODY, key_headers(key))
    dying.wait_served()
    # Envoy's own reply once its retries failed to connect: the router's 503.
    assert first.status == 503, first
    assert b"connection failure" in first.body, first
    assert dying.executions == before + 1
    envoy.wait_counter("upstream_retried", retried + 1)
    return first


def test_on_a_refuse_rule_the_retry_gets_502_outcome_unknown(envoy, dying):
    key = new_key()
    released, unknown = envoy.idem("released"), envoy.idem("outcome_unknown")
    _executed_then_refused(envoy, dying, "/dying-pay", key)
    envoy.wait_counter("outcome_unknown", unknown + 1)
    assert envoy.idem("released") == released
    executions = dying.executions
    retry = envoy.post("/dying-pay", BODY, key_headers(key))
    assert_problem(retry, 502, "outcome-unknown")
    assert dying.executions == executions


def test_on_a_takeover_rule_the_retry_finds_it_in_flight(envoy, dying):
    key = new_key()
    released = envoy.idem("released")
    _executed_then_refused(envoy, dying, "/dying-orders", key)
    assert envoy.idem("released") == released
    retry = envoy.post("/dying-orders", BODY, key_headers(key))
    assert_problem(retry, 409, "request-in-flight")


def test_one_attempt_that_never_connected_is_still_released(envoy):
    """No retry policy: the one attempt was refused, nothing ran, the claim is given back."""
    key = new_key()
    released = envoy.idem("released")
    first = envoy.post("/unreachable", BODY, key_headers(key))
    assert first.status == 503, first
    envoy.wait_counter("released", released + 1)
    again = envoy.post("/unreachable", BODY, key_headers(key))
    assert again.status == 503, again
    envoy.wait_counter("released", released + 2)
