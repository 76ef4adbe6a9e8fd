"""C18: a full store refuses new keys with 503 store-full until records expire.

capacity 8 fits in one bucket of 8 entries, which every key shares (a store that small has no
placement to balance), so the 9th distinct live key is refused. test_store_capacity.py fills a
store with two buckets per key to its capacity."""

from __future__ import annotations

import threading

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

TTL_S = 3

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 8},
    # one principal (anonymous) fills the store; a quota as large as the store never refuses it
    "quota": {"per_tenant": 8, "per_principal": 8},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "ttl": "%ds" % TTL_S, "processing_timeout": "%ds" % TTL_S}],
}

BODY = b'{"qty":1}'


def _post(envoy, key, **extra):
    headers = key_headers(key, **extra)
    return envoy.post("/orders", BODY, headers, timeout=30)


def test_store_full_then_space_after_ttl(envoy, upstream):
    keys = [new_key() for _ in range(8)]
    results = {}
    swept_before = envoy.counter(harness.SWEPT_STAT)
    full_before = envoy.idem("store_full")

    def hold(k):
        results[k] = _post(envoy, k, x_delay_ms="1500")

    threads = [threading.Thread(target=hold, args=(k,), daemon=True) for k in keys]
    for t in threads:
        t.start()
    harness.wait_until(lambda: all(upstream.executions(k) == 1 for k in keys), 10,
                       what="8 requests in flight")

    # 8 PROCESSING records fill the store: a 9th key is refused, the upstream is not called
    ninth = new_key()
    r = _post(envoy, ninth)
    assert_problem(r, 503, "store-full")
    retry_after_seconds(r)
    assert upstream.executions(ninth) == 0
    envoy.wait_counter("store_full", full_before + 1)

    for t in threads:
        t.join(30)
    assert [results[k].status for k in keys] == [201] * 8, results

    # completed records still hold their space until their ttl: still full...
    assert_problem(_post(envoy, ninth), 503, "store-full")
    # ... and they still replay
    assert _post(envoy, keys[0]).replayed

    # after the ttl the periodic sweep reclaims the records (nobody claims meanwhile, so only
    # the sweep can free them) ...
    envoy.wait_counter(harness.SWEPT_STAT, swept_before + 1, timeout=TTL_S + 10)
    # ... and a new key is accepted again
    accepted = _post(envoy, ninth)
    assert accepted.status == 201 and not accepted.replayed, accepted
    assert upstream.executions(ninth) == 1
    # as are the old keys, which execute afresh now that their records are gone
    fresh = _post(envoy, keys[1])
    assert fresh.status == 201 and not fresh.replayed, fresh
    assert upstream.executions(keys[1]) == 2
