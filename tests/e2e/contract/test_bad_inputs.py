"""C1, C4, C7, C9, C14: hostile inputs aimed at a record that already exists. Every hostile
request gets a clear answer (400 invalid-key, 413, 422, or the pass-through of a route no rule
matches) and the stored record stays exactly as it was (the original still replays, the upstream
ran once). Also: keys and credentials never reach
the logs raw."""

from __future__ import annotations

import socket
import time

import pytest

import harness
from harness import assert_problem, new_key

LIMIT = 4096

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "tenant_header": "x-tenant-id",
    "routes": [{"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]},
                "require_key": True, "max_request_bytes": LIMIT},
               {"name": "deep", "match": {"prefix": "/deep"}, "require_key": True,
                "max_request_bytes": 65536}],
}

BODY = b'{"item":"book","qty":1}'
SECRET = "Bearer s3cr3t-token-that-must-not-be-logged"


def _stored(envoy, upstream):
    """A completed record to attack: path, key, its first response."""
    key = new_key()
    path = "/orders/" + key
    first = envoy.post(path, BODY, {"content-type": "application/json", "idempotency-key": key,
                                    "authorization": SECRET})
    assert first.status == 201 and not first.replayed
    return path, key, first


def _still_intact(envoy, upstream, path, key, first):
    again = envoy.post(path, BODY, {"content-type": "application/json", "idempotency-key": key,
                                    "authorization": SECRET})
    assert again.status == 201 and again.replayed, again
    assert again.body == first.body
    assert upstream.path_executions(path) == 1


def _raw(envoy, path, key_value, body=BODY, extra=(), chunks=None):
    headers = [("content-type", "application/json"), ("authorization", SECRET)]
    if key_value is not None:
        headers.append((b"idempotency-key", key_value))
    headers.extend(extra)
    if chunks is not None:
        return envoy.raw("POST", path, headers, chunks=chunks)
    return envoy.raw("POST", path, headers, body)


@pytest.mark.parametrize("bad", [
    b"",
    b"k" * 256,
    b"has space",
    b"has\ttab",
    b"caf\xc3\xa9",
    b'"unterminated',
])
def test_bad_keys_leave_the_record_alone(envoy, upstream, bad):
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, bad)
    assert r.status == 400, r
    if r.header("content-type") == "application/problem+json":
        assert_problem(r, 400, "invalid-key")
    _still_intact(envoy, upstream, path, key, first)


def test_two_key_headers_leave_the_record_alone(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, key.encode(), extra=[("idempotency-key", key)])
    assert_problem(r, 400, "invalid-key")
    _still_intact(envoy, upstream, path, key, first)


def test_body_one_byte_over_the_limit_leaves_the_record_alone(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, key.encode(), body=b"x" * (LIMIT + 1))
    assert_problem(r, 413, "request-too-large")
    _still_intact(envoy, upstream, path, key, first)


def test_chunked_body_over_the_limit_leaves_the_record_alone(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, key.encode(), chunks=[b"x" * 1000] * 5)
    assert_problem(r, 413, "request-too-large")
    _still_intact(envoy, upstream, path, key, first)


def test_malformed_json_with_the_same_key_is_a_mismatch(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, key.encode(), body=b'{"item":"book",')
    assert_problem(r, 422, "payload-mismatch")
    _still_intact(envoy, upstream, path, key, first)


def test_json_nested_10000_deep_is_answered_without_harm(envoy, upstream):
    # Deeper than the canonicalizer's limit: hashed as raw bytes (documented), so it is a
    # well-defined payload: a new key executes once and replays; the stored record is untouched.
    deep = b"[" * 10000 + b"]" * 10000
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, key.encode(), body=deep[:LIMIT // 2] + deep[-(LIMIT // 2):])
    assert_problem(r, 422, "payload-mismatch")
    _still_intact(envoy, upstream, path, key, first)
    fresh = "/deep/" + new_key()
    r1 = envoy.post(fresh, deep, {"content-type": "application/json", "idempotency-key": "deep"})
    r2 = envoy.post(fresh, deep, {"content-type": "application/json", "idempotency-key": "deep"})
    assert r1.status == 201 and r2.replayed and r1.body == r2.body
    assert "panicked" not in envoy.log_text()


def test_one_mib_header_is_refused_by_envoy(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    r = _raw(envoy, path, key.encode(), extra=[("x-big", "v" * (1 << 20))])
    assert r.status == 431, r
    _still_intact(envoy, upstream, path, key, first)


def test_key_header_on_a_non_matching_route_passes_through(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    other = "/other/" + new_key()
    for _ in range(2):
        r = _raw(envoy, other, key.encode())
        assert r.status == 201 and not r.replayed
    assert upstream.path_executions(other) == 2
    _still_intact(envoy, upstream, path, key, first)


def test_client_gone_mid_body_leaves_the_record_alone(envoy, upstream):
    path, key, first = _stored(envoy, upstream)
    head = harness.build_request("POST", path, [("idempotency-key", key), ("authorization", SECRET),
                                                ("content-length", "1000")])
    with socket.create_connection(("127.0.0.1", envoy.port), timeout=5) as s:
        s.sendall(head + b"x" * 100)
        time.sleep(0.2)
    time.sleep(0.3)
    _still_intact(envoy, upstream, path, key, first)


def test_keys_and_credentials_never_reach_the_log_raw(envoy, upstream):
    key = "very-distinctive-key-" + new_key()
    envoy.post("/orders/x", BODY, {"idempotency-key": key, "authorization": SECRET,
                                   "x-tenant-id": "tenant-distinctive-name"})
    envoy.post("/orders/x", BODY, {"idempotency-key": key, "authorization": SECRET,
                                   "x-tenant-id": "tenant-distinctive-name"})
    log = envoy.log_text()
    assert "replayed key" in log, "decision lines are logged (at debug)"
    for secret in (key, "s3cr3t-token", "tenant-distinctive-name"):
        assert secret not in log
    assert key not in envoy.prometheus() and key not in str(envoy.stats())
