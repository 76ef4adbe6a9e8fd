"""C14, C9: the request fingerprint (method, path, query, listed headers, canonical body). Another
payload under a key gets 422 and leaves the record alone (C14); a body that is canonically the
same (member order, whitespace, ignored fields, escapes) replays (C9)."""

from __future__ import annotations

import pytest

from harness import assert_problem, new_key, sha256

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {
            "name": "orders",
            "match": {"prefix": "/orders", "methods": ["POST"]},
            "require_key": True,
            "fingerprint": {
                "headers": ["content-type", "x-api-version"],
                "ignore_json_fields": ["/meta/sent_at", "/trace~1id"],
            },
        }
    ],
}

JSON = "application/json"


def _post(envoy, key, body, ctype=JSON, path="/orders", **extra):
    headers = {"idempotency-key": key}
    if ctype is not None:
        headers["content-type"] = ctype
    headers.update({k.replace("_", "-"): v for k, v in extra.items()})
    return envoy.post(path, body, headers)


def _replay_of(first, again):
    assert first.status == 201 and not first.replayed, first
    assert again.status == 201 and again.replayed, again
    assert again.header("x-execution") == first.header("x-execution")
    assert again.body == first.body


def _mismatch(upstream, key, r):
    assert_problem(r, 422, "payload-mismatch")
    assert upstream.executions(key) == 1


def test_json_member_order_and_whitespace_do_not_matter(envoy, upstream):
    key = new_key()
    first = _post(envoy, key, b'{"amount": 10, "currency": "EUR", "meta": {"src": "web"}, "items": [1, 2]}')
    again = _post(envoy, key, b'{ "items":[1,2],\n  "meta":{"src":"web"},"currency":"EUR","amount":10 }')
    _replay_of(first, again)
    assert upstream.executions(key) == 1


def test_plus_json_is_canonicalized(envoy, upstream):
    key = new_key()
    ctype = "application/vnd.orders+json"
    first = _post(envoy, key, b'{"a":1,"b":{"c":2,"d":3}}', ctype)
    again = _post(envoy, key, b'{"b":{"d":3,"c":2},"a":1}', ctype)
    _replay_of(first, again)


def test_ignored_json_fields_do_not_matter(envoy, upstream):
    key = new_key()
    original = b'{"amount":10,"meta":{"sent_at":"2024-01-01T00:00:00Z","src":"web"},"trace/id":"a"}'
    first = _post(envoy, key, original)
    again = _post(envoy, key, b'{"amount":10,"meta":{"sent_at":"2024-01-01T00:00:07Z","src":"web"},"trace/id":"b"}')
    _replay_of(first, again)
    # an ignored field may also be absent
    third = _post(envoy, key, b'{"amount":10,"meta":{"src":"web"}}')
    _replay_of(first, third)
    # the upstream got the body exactly as the client sent it
    assert [r["body_sha256"] for r in upstream.requests(key)] == [sha256(original)]


def test_different_body_is_422_and_leaves_the_record_alone(envoy, upstream):
    key = new_key()
    before = envoy.idem("mismatch")
    first = _post(envoy, key, b'{"amount":10}')
    r = _post(envoy, key, b'{"amount":11}')
    _mismatch(upstream, key, r)
    envoy.wait_counter("mismatch", before + 1)
    # the record is untouched: the original request still replays
    _replay_of(first, _post(envoy, key, b'{"amount":10}'))
    # and a different body is still refused
    assert_problem(_post(envoy, key, b'{"amount":11}'), 422, "payload-mismatch")
    assert upstream.executions(key) == 1


def test_different_non_ignored_nested_field_is_422(envoy, upstream):
    key = new_key()
    assert _post(envoy, key, b'{"amount":10,"meta":{"sent_at":"x","src":"web"}}').status == 201
    r = _post(envoy, key, b'{"amount":10,"meta":{"sent_at":"x","src":"app"}}')
    _mismatch(upstream, key, r)


def _compared(envoy, upstream, same: dict, other: dict):
    """`same` and `other` (keyword arguments of _post) differ in one part of the fingerprint:
    the same key with `other` is a 422, with `same` again a replay."""
    key = new_key()
    first = _post(envoy, key, b"{}", **same)
    _mismatch(upstream, key, _post(envoy, key, b"{}", **other))
    _replay_of(first, _post(envoy, key, b"{}", **same))


def test_different_query_is_422(envoy, upstream):
    _compared(envoy, upstream, {"path": "/orders?dry_run=false"}, {"path": "/orders?dry_run=true"})


def test_query_is_compared_as_sent(envoy, upstream):
    key = new_key()
    assert _post(envoy, key, b"{}", path="/orders?a=1&b=2").status == 201
    r = _post(envoy, key, b"{}", path="/orders?b=2&a=1")  # not reordered
    _mismatch(upstream, key, r)


def test_fingerprint_header_is_compared(envoy, upstream):
    _compared(envoy, upstream, {"x_api_version": "2024-01"}, {"x_api_version": "2025-06"})


def test_other_headers_are_not_compared(envoy, upstream):
    key = new_key()
    first = _post(envoy, key, b"{}", user_agent="a/1", x_request_note="first")
    again = _post(envoy, key, b"{}", user_agent="b/2", x_request_note="retry")
    _replay_of(first, again)


@pytest.mark.parametrize("ctype", ["text/plain", "application/octet-stream", None])
def test_non_json_bodies_compare_as_raw_bytes(envoy, upstream, ctype):
    key = new_key()
    first = _post(envoy, key, b'{"a":1,"b":2}', ctype)
    _replay_of(first, _post(envoy, key, b'{"a":1,"b":2}', ctype))
    r = _post(envoy, key, b'{"b":2,"a":1}', ctype)
    _mismatch(upstream, key, r)


@pytest.mark.parametrize("a,b", [(b'{"amount":1}', b'{"amount":1.0}'),
                                 (b'{"amount":100}', b'{"amount":1e2}'),
                                 (b'{"amount":0.5}', b'{"amount":0.50}')])
def test_numbers_keep_their_text(envoy, upstream, a, b):
    key = new_key()
    assert _post(envoy, key, a).status == 201
    r = _post(envoy, key, b)
    _mismatch(upstream, key, r)


def test_json_string_escapes_are_normalized(envoy, upstream):
    key = new_key()
    first = _post(envoy, key, b'{"name":"caf\\u00e9","path":"a\\/b"}')
    again = _post(envoy, key, '{"name":"caf\u00e9","path":"a/b"}'.encode("utf-8"))
    _replay_of(first, again)


def test_duplicate_members_are_hashed_as_raw_bytes(envoy, upstream):
    key = new_key()
    body = b'{"a":1,"a":1}'
    first = _post(envoy, key, body)
    _replay_of(first, _post(envoy, key, body))
    _mismatch(upstream, key, _post(envoy, key, b'{"a":1, "a":1}'))


def test_malformed_json_is_hashed_as_raw_bytes(envoy, upstream):
    key = new_key()
    body = b'{"amount": 10, "currency": '
    first = _post(envoy, key, body)
    assert first.status == 201, first  # the filter does not reject it: the upstream decides
    _replay_of(first, _post(envoy, key, body))
    r = _post(envoy, key, b'{"amount":10,"currency":')
    _mismatch(upstream, key, r)


def test_empty_body_replays(envoy, upstream):
    key = new_key()
    first = _post(envoy, key, b"", ctype=None)
    _replay_of(first, _post(envoy, key, b"", ctype=None))
