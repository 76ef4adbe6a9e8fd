"""C14 with `problem_statuses`: the mismatch answered with the configured status, the other
problems keeping theirs (the shape of problems is checked everywhere by harness.assert_problem)."""

from __future__ import annotations

from harness import assert_problem, new_key

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "problem_statuses": {"mismatch": 409},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}


def _post(envoy, key, body):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["idempotency-key"] = key
    return envoy.post("/orders", body, headers)


def test_mismatch_status_is_overridden(envoy, upstream):
    key = new_key()
    assert _post(envoy, key, b'{"qty":1}').status == 201
    doc = assert_problem(_post(envoy, key, b'{"qty":2}'), 409, "payload-mismatch")
    assert doc["status"] == 409
    assert upstream.executions(key) == 1


def test_other_statuses_keep_their_defaults(envoy, upstream):
    assert_problem(_post(envoy, None, b"{}"), 400, "missing-key")
    assert_problem(_post(envoy, "bad key", b"{}"), 400, "invalid-key")
