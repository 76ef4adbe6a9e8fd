"""C22: a caller cannot steer how long or how often Envoy sends a protected request upstream.

Envoy's router obeys `x-envoy-*` control headers from the request (`x-envoy-retry-on`,
`x-envoy-upstream-rq-timeout-ms`, ...; the list is src/router_control.rs). Envoy strips them from
external callers, but keeps them when it counts the caller as internal, as an edge Envoy behind
an internal load balancer does (`use_remote_address` with an `internal_address_config` covering
the caller): this module's listener. The async client that carries a detached call obeys them
too, from the call's own headers. Before issue 30 a caller could so:
- lift `upstream_timeout` past the lease: the client got its 201 after every retry had been
  told 502 `outcome-unknown` (the answer lost), or on a `takeover` rule a retry ran beside it;
- ask for retries: one key, two executions, on detached and on inline routes.
Now a protected request goes upstream without them (counted as `router_controls_removed`);
unprotected traffic keeps them.
"""

from __future__ import annotations

import threading
import time

import harness
from harness import assert_problem, key_headers, new_key

LEASE_S = 3
UPSTREAM_TIMEOUT_S = 2


def _detached(name: str, prefix: str, **extra) -> dict:
    return harness.detached_rule(name, prefix, LEASE_S, UPSTREAM_TIMEOUT_S, **extra)


FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        _detached("pay", "/pay"),
        _detached("paytk", "/takeover", unknown_outcome="takeover"),
        {"name": "inl", "match": {"prefix": "/inl"}, "require_key": True, "processing_timeout": "30s"},
    ],
}
ENVOY_OPTIONS = {"concurrency": 2, "hcm_options": harness.internal_callers()}

BODY = b'{"amount":4200,"currency":"EUR"}'


def _post(envoy, path, key, **extra):
    return envoy.post(path, BODY, key_headers(key, **extra), timeout=15)


def test_the_listener_trusts_its_callers_so_envoy_keeps_their_control_headers(envoy, upstream):
    """The premise: on this listener Envoy's router obeys a caller's retry header on a route the
    filter does not protect (the upstream's first answer, a 503, is retried: two executions)."""
    key = new_key()
    resp = envoy.post("/open", BODY, key_headers(key, **{"x-fail-first": "503", "x-envoy-retry-on": "5xx"}))
    assert resp.status == 201, resp
    assert upstream.executions(key) == 2


def test_a_caller_cannot_lift_upstream_timeout_on_a_detached_route(envoy, upstream):
    """The caller asks for 20 s; the upstream takes 5 s. The call still ends at upstream_timeout
    with 504 outcome-unknown, and every retry says the same (502): the client never gets a 201
    that its retries were told is unknown."""
    key = new_key()
    controls = {"x-delay-ms": "5000", "x-envoy-upstream-rq-timeout-ms": "20000"}
    t0 = time.monotonic()
    first = _post(envoy, "/pay", key, **controls)
    elapsed = time.monotonic() - t0
    assert_problem(first, 504, "outcome-unknown")
    assert elapsed < UPSTREAM_TIMEOUT_S + 1.5, elapsed
    time.sleep(max(0.0, t0 + 3.6 - time.monotonic()))
    assert_problem(_post(envoy, "/pay", key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1
    (seen,) = upstream.requests(key)
    assert not any(n.startswith("x-envoy-upstream-rq") for n, _ in seen["headers"]), seen["headers"]


def test_a_caller_cannot_keep_a_detached_call_running_past_the_lease_on_a_takeover_rule(envoy, upstream):
    """On a takeover rule a retry after the lease executes again by design, so the call must be
    over by then: the caller's 20 s do not keep it running, and a retry inside the lease gets 409."""
    key = new_key()
    t0 = time.monotonic()
    first = _post(envoy, "/takeover", key, **{"x-delay-ms": "5000", "x-envoy-upstream-rq-timeout-ms": "20000"})
    assert_problem(first, 504, "outcome-unknown")
    assert time.monotonic() - t0 < UPSTREAM_TIMEOUT_S + 1.5
    assert_problem(_post(envoy, "/takeover", key), 409, "request-in-flight")
    assert upstream.executions(key) == 1


def test_a_caller_cannot_shorten_a_detached_call_into_an_unknown_outcome(envoy, upstream):
    """The other direction: 300 ms asked, the upstream answers in 1 s. The call waits for the
    answer (upstream_timeout is the bound), stores it, and the retry replays it."""
    key = new_key()
    first = _post(envoy, "/pay", key, **{"x-delay-ms": "1000", "x-envoy-upstream-rq-timeout-ms": "300"})
    assert first.status == 201 and not first.replayed, first
    retry = _post(envoy, "/pay", key)
    assert retry.status == 201 and retry.replayed and retry.body == first.body, retry
    assert upstream.executions(key) == 1


def test_a_caller_cannot_ask_a_detached_call_for_retries(envoy, upstream):
    """The upstream's first answer is a 503 (released: nothing stored). Asked to retry 5xx, the
    async client would execute the key again under the same claim; instead the client gets the
    503 and its own retry executes once more."""
    key = new_key()
    extra = {"x-fail-first": "503", "x-envoy-retry-on": "5xx", "x-envoy-max-retries": "3"}
    first = _post(envoy, "/pay", key, **extra)
    assert first.status == 503, first
    assert upstream.executions(key) == 1
    retry = _post(envoy, "/pay", key, **extra)
    assert retry.status == 201 and not retry.replayed, retry
    assert upstream.executions(key) == 2


def test_a_caller_cannot_ask_the_router_for_retries_on_an_inline_route(envoy, upstream):
    """Inline, the filter takes the control headers off before the router sees them, and counts
    it; the upstream never sees them."""
    key = new_key()
    removed = envoy.idem("router_controls_removed")
    extra = {"x-fail-first": "503", "x-envoy-retry-on": "5xx", "x-envoy-max-retries": "3",
             "x-envoy-hedge-on-per-try-timeout": "true"}
    first = _post(envoy, "/inl", key, **extra)
    assert first.status == 503, first
    assert upstream.executions(key) == 1
    envoy.wait_counter("router_controls_removed", removed + 1)
    (seen,) = upstream.requests(key)
    assert not any(n.startswith(("x-envoy-retry", "x-envoy-max", "x-envoy-hedge")) for n, _ in seen["headers"])
    retry = _post(envoy, "/inl", key)
    assert retry.status == 201, retry
    assert upstream.executions(key) == 2


def test_concurrent_trusted_callers_each_execute_once(envoy, upstream):
    """Eight keys at once, each asking for retries of an upstream that fails first: one
    execution each."""
    keys = [new_key() for _ in range(8)]
    results = {}

    def call(k, path):
        results[k] = _post(envoy, path, k, **{"x-fail-first": "503", "x-envoy-retry-on": "5xx"})

    threads = [threading.Thread(target=call, args=(k, "/pay" if i % 2 else "/inl")) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(results[k].status == 503 for k in keys), results
    assert all(upstream.executions(k) == 1 for k in keys)
