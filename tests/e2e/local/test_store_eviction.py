"""C18: on a `takeover` rule, abandoned claims are evicted first. capacity 8 is exactly one
bucket of 8 entries. (On a rule that refuses unknown outcomes, the default, these records are
completed as outcome unknown and kept for their ttl.)

Eight claims whose outcome is unknown (`x-reset: before-headers`: the upstream got the request
and dropped the connection) stay PROCESSING for their lease (processing_timeout 2s). While the
leases are live, a new key gets 503 `store-full`; once they have ended, a new key evicts one of
them and is forwarded (201), although the ttl (1h) is far away (once a sweep pass has also stopped
counting them against the caller's quota: until then the new key gets 429). Quota is set as large as the
store so that only the store bounds this one principal while the quota is exercised too.

(Before eviction: 503 `store-full` until the ttl.)
"""

from __future__ import annotations

import time

from harness import assert_problem, key_headers, new_key, retry_after_seconds

LEASE_S = 2

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 8},
    "quota": {"per_tenant": 8, "per_principal": 8},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "ttl": "1h", "processing_timeout": "%ds" % LEASE_S, "unknown_outcome": "takeover"}],
}

BODY = b'{"qty":1}'


def _post(envoy, key, **extra):
    headers = key_headers(key, **extra)
    return envoy.post("/orders", BODY, headers, timeout=30)


def test_abandoned_claims_are_evicted_after_their_lease(envoy, upstream):
    unknown = envoy.idem("kept_unknown")
    since = time.monotonic()
    keys = [new_key() for _ in range(8)]
    for k in keys:
        r = _post(envoy, k, x_reset="before-headers")
        assert r.status == 503 and not r.replayed, r  # Envoy's own 503: the upstream reset
    envoy.wait_counter("kept_unknown", unknown + 8)
    assert all(upstream.executions(k) == 1 for k in keys)

    # the leases are live: the store is full
    ninth = new_key()
    r = _post(envoy, ninth)
    assert time.monotonic() - since < LEASE_S, "too slow to observe the live leases"
    assert_problem(r, 503, "store-full")
    retry_after_seconds(r)
    assert upstream.executions(ninth) == 0

    # past the leases the abandoned claims may be evicted: the new key is forwarded. Until the
    # next sweep pass (every second) they still count against this caller's quota (429).
    remaining = since + LEASE_S + 0.1 - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
    deadline = time.monotonic() + 5
    while True:
        accepted = _post(envoy, ninth)
        if accepted.status != 429 or time.monotonic() > deadline:
            break
        assert_problem(accepted, 429, "quota-exceeded")
        time.sleep(0.2)
    assert accepted.status == 201 and not accepted.replayed, accepted
    assert upstream.executions(ninth) == 1
    again = _post(envoy, ninth)
    assert again.replayed and again.header("x-execution") == accepted.header("x-execution")
