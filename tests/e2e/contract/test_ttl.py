"""C9, C8: a stored record replays until its ttl (C9), then the key executes again (C8)."""

from __future__ import annotations

import harness
from harness import new_key

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "ttl": "2s", "processing_timeout": "1s"}],
}

BODY = b'{"qty":1}'


def _post(envoy, key):
    return envoy.post("/orders", BODY, {"content-type": "application/json", "idempotency-key": key})


def test_replay_until_ttl_then_execute_again(envoy, upstream):
    key = new_key()
    first = _post(envoy, key)
    assert first.status == 201 and not first.replayed, first
    again = _post(envoy, key)
    assert again.replayed and again.header("x-execution") == first.header("x-execution"), again

    def executed_again():
        r = _post(envoy, key)
        if r.replayed:
            assert r.header("x-execution") == first.header("x-execution"), r
            return None
        return r

    fresh = harness.wait_until(executed_again, 10, 0.1, "the ttl to pass")
    assert fresh.status == 201, fresh
    assert fresh.header("x-execution") != first.header("x-execution")
    assert upstream.executions(key) == 2
    # the new execution is the new record
    later = _post(envoy, key)
    assert later.replayed and later.header("x-execution") == fresh.header("x-execution")
