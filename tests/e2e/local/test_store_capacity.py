"""C18: the local store is usable to its capacity. Two-choice placement over 1.5 positions
per record (capacity 200: 38 buckets of 8) lets new keys in until `capacity` records are live,
then refuses every new key with 503 store-full, and evicts none of the live records.

With one bucket per key (the previous placement: 25 buckets of 8), about a tenth of the new keys
were refused by 90% fill, and the store never reached 200 records."""

from __future__ import annotations

from harness import assert_problem, key_headers, new_key, retry_after_seconds

CAPACITY = 200

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": CAPACITY},
    # one principal (anonymous) fills the store; a quota as large as the store never stops it
    "quota": {"per_tenant": CAPACITY, "per_principal": CAPACITY},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "ttl": "1h", "processing_timeout": "30s"}],
}

BODY = b'{"qty":1}'


def _post(envoy, key):
    return envoy.post("/orders", BODY, key_headers(key), timeout=30)


def test_store_takes_new_keys_up_to_its_capacity_then_only_refuses(envoy, upstream):
    full_before = envoy.idem("store_full")
    stored = []
    # up to 90% of capacity, no new key is refused
    for _ in range(CAPACITY * 9 // 10):
        key = new_key()
        r = _post(envoy, key)
        assert r.status == 201 and not r.replayed, (len(stored), r)
        stored.append(key)
    assert envoy.idem("store_full") == full_before

    # the last 10% fill too: near the top a key whose two buckets are both full may be refused
    # (rarely), but the store reaches its capacity
    refused_on_the_way = 0
    while len(stored) < CAPACITY and refused_on_the_way < CAPACITY // 2:
        key = new_key()
        r = _post(envoy, key)
        if r.status == 201:
            stored.append(key)
        else:
            assert_problem(r, 503, "store-full")
            refused_on_the_way += 1
    assert len(stored) == CAPACITY, "%d records, %d refused" % (len(stored), refused_on_the_way)

    # at capacity: every new key is refused, never forwarded
    for _ in range(20):
        key = new_key()
        r = _post(envoy, key)
        assert_problem(r, 503, "store-full")
        retry_after_seconds(r)
        assert upstream.executions(key) == 0
    envoy.wait_counter("store_full", full_before + refused_on_the_way + 20)
    assert envoy.idem("store_full") == full_before + refused_on_the_way + 20

    # and no live record gave its place: each one replays its single execution
    for key in stored:
        r = _post(envoy, key)
        assert r.replayed, r
        assert upstream.executions(key) == 1
