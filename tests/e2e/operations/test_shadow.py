"""Shadow mode (issue 47; an operations promise, no contract row): with `"mode": "shadow"` the
filter claims, fingerprints and records as usual but never answers for the upstream. A duplicate
and a mismatch are forwarded, so the upstream executes each, and the `shadow_replayed` and
`shadow_mismatch` counters (and the access log's outcome) say what enforcing would have done; a
request without the required key is forwarded too (`shadow_missing_key`). The record the first
request wrote is the one an enforcing filter then replays. Fails on a build before `mode`, which
refuses the field."""

from __future__ import annotations

from harness import key_headers, new_key

FILTER_CONFIG = {
    "mode": "shadow",
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]}, "require_key": True}],
}

BODY = b'{"item":"book","qty":1}'


def test_a_duplicate_and_a_mismatch_are_forwarded_and_counted(envoy, upstream):
    key = new_key()
    before = envoy.outcomes()
    first = envoy.post("/orders", BODY, key_headers(key))
    again = envoy.post("/orders", BODY, key_headers(key))
    other = envoy.post("/orders", b'{"item":"book","qty":2}', key_headers(key))
    assert [r.status for r in (first, again, other)] == [201, 201, 201], (first, again, other)
    assert not again.replayed and not other.replayed, (again, other)
    # Each executed: the upstream saw three requests under the key.
    assert upstream.executions(key) == 3
    assert first.header("x-execution") != again.header("x-execution")
    envoy.wait_counter("shadow_mismatch", before.get("shadow_mismatch", 0) + 1)
    after = envoy.outcomes()
    for outcome, grew in (("claimed", 1), ("stored", 1), ("shadow_replayed", 1), ("shadow_mismatch", 1),
                          ("replayed", 0), ("mismatch", 0)):
        assert after.get(outcome, 0) - before.get(outcome, 0) == grew, (outcome, before, after)


def test_a_request_without_its_required_key_is_forwarded(envoy, upstream):
    before = envoy.idem("shadow_missing_key")
    resp = envoy.post("/orders", BODY, {"content-type": "application/json"})
    assert resp.status == 201, resp
    envoy.wait_counter("shadow_missing_key", before + 1)
    assert envoy.idem("missing_key") == 0
