"""C7: request bodies over max_request_bytes are refused with 413, claiming nothing."""

from __future__ import annotations

import pytest

from harness import assert_problem, new_key

LIMIT = 1024

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "max_request_bytes": LIMIT}],
}


def _json_of_size(n: int) -> bytes:
    head, tail = b'{"pad":"', b'"}'
    return head + b"x" * (n - len(head) - len(tail)) + tail


def _headers(key):
    return [("content-type", "application/json"), ("idempotency-key", key)]


def _small_retry_executes(envoy, upstream, key):
    r = envoy.post("/orders", b'{"qty":1}', dict(_headers(key)))
    assert r.status == 201 and not r.replayed, r
    assert upstream.executions(key) == 1
    again = envoy.post("/orders", b'{"qty":1}', dict(_headers(key)))
    assert again.replayed, again


def test_body_at_the_limit_is_accepted(envoy, upstream):
    key = new_key()
    body = _json_of_size(LIMIT)
    r = envoy.post("/orders", body, dict(_headers(key)))
    assert r.status == 201 and r.json()["received_bytes"] == LIMIT, r
    assert envoy.post("/orders", body, dict(_headers(key))).replayed


@pytest.mark.parametrize("size", [LIMIT + 1, 100 * 1024])
def test_content_length_over_the_limit_is_413(envoy, upstream, size):
    key = new_key()
    before = envoy.idem("too_large")
    r = envoy.post("/orders", _json_of_size(size), dict(_headers(key)))
    assert_problem(r, 413, "request-too-large")
    assert upstream.executions(key) == 0
    envoy.wait_counter("too_large", before + 1)
    # nothing was claimed: the same key with a small body executes normally
    _small_retry_executes(envoy, upstream, key)


@pytest.mark.parametrize("size", [LIMIT + 1, 100 * 1024])
def test_chunked_body_over_the_limit_is_413(envoy, upstream, size):
    key = new_key()
    body = _json_of_size(size)
    chunks = [body[i:i + 300] for i in range(0, len(body), 300)]
    r = envoy.raw("POST", "/orders", _headers(key), chunks=chunks)
    assert_problem(r, 413, "request-too-large")
    assert upstream.executions(key) == 0
    _small_retry_executes(envoy, upstream, key)


def test_chunked_body_under_the_limit_is_fine(envoy, upstream):
    key = new_key()
    body = _json_of_size(LIMIT - 10)
    r = envoy.raw("POST", "/orders", _headers(key), chunks=[body[:100], body[100:]])
    assert r.status == 201 and r.json()["received_bytes"] == LIMIT - 10, r
    # a chunked retry and a content-length retry carry the same body: a replay either way
    assert envoy.post("/orders", body, dict(_headers(key))).replayed


def test_limit_does_not_apply_outside_the_rules(envoy, upstream):
    r = envoy.post("/elsewhere", _json_of_size(100 * 1024), {"content-type": "application/json"})
    assert r.status == 201, r
