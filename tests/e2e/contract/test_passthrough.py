"""C1: a request that matches no rule (path or method) passes through untouched."""

from __future__ import annotations

from harness import new_key

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]}, "require_key": True},
        {"name": "exact", "match": {"exact": "/exact"}, "require_key": True},
        # methods default to POST and PATCH; require_key defaults to false
        {"name": "defaults", "match": {"prefix": "/defaults"}},
    ],
}


def _twice(envoy, method, path, key_value, body=b'{"a":1}'):
    headers = {"content-type": "application/json"}
    if key_value is not None:
        headers["idempotency-key"] = key_value
    return [envoy.request(method, path, body, headers) for _ in range(2)]


def _assert_executed_twice(responses):
    assert [r.status for r in responses] == [201, 201], responses
    assert not any(r.replayed for r in responses), responses
    assert responses[0].header("x-execution") != responses[1].header("x-execution")


def test_unmatched_path_with_key_executes_every_time(envoy, upstream):
    key = new_key()
    before = envoy.idem("passed_through")
    _assert_executed_twice(_twice(envoy, "POST", "/other/" + key, key))
    assert upstream.executions(key) == 2
    envoy.wait_counter("passed_through", before + 2)


def test_unmatched_method_with_key_executes_every_time(envoy, upstream):
    key = new_key()
    for method in ("GET", "PUT", "PATCH", "DELETE"):  # the rule lists POST only
        _assert_executed_twice(_twice(envoy, method, "/orders/" + new_key(), key))
    assert upstream.executions(key) == 8


def test_unmatched_request_with_malformed_key_passes(envoy, upstream):
    for bad in ("has space", "", "x" * 300, '"unterminated'):
        path = "/other/" + new_key()
        _assert_executed_twice(_twice(envoy, "POST", path, bad))
        assert upstream.path_executions(path) == 2
    # a repeated key header on an unmatched path is not the filter's business either
    key = new_key()
    for _ in range(2):
        r = envoy.raw("POST", "/other", [("idempotency-key", key), ("idempotency-key", key)], b"{}")
        assert r.status == 201 and not r.replayed, r
    assert upstream.executions(key + ", " + key) == 2


def test_unmatched_request_without_key_passes(envoy, upstream):
    path = "/other/" + new_key()
    _assert_executed_twice(_twice(envoy, "POST", path, None))
    assert upstream.path_executions(path) == 2


def test_exact_match_is_exact(envoy, upstream):
    # /exact/sub does not match the exact rule: no key needed
    path = "/exact/" + new_key()
    _assert_executed_twice(_twice(envoy, "POST", path, None))
    # /exact itself requires a key
    r = envoy.post("/exact", b"{}", {"content-type": "application/json"})
    assert r.status == 400, r


def test_default_methods_are_post_and_patch(envoy, upstream):
    for method in ("POST", "PATCH"):
        key = new_key()
        first, second = _twice(envoy, method, "/defaults/x", key)
        assert first.status == 201 and not first.replayed, first
        assert second.status == 201 and second.replayed, second
        assert upstream.executions(key) == 1
    key = new_key()
    _assert_executed_twice(_twice(envoy, "PUT", "/defaults/x", key))
    assert upstream.executions(key) == 2
