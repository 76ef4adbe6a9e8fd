"""C9, C6: replays that Envoy's local-reply path would rewrite are still the first answer (C9),
and gRPC calls, whose replays it would turn into failures, are refused (C6).

A replay is sent as a local reply, and Envoy rewrites local replies: it drops `content-type`
when the body is empty, adds `text/plain` to a body without one, and turns the reply to a gRPC
request into a trailers-only failure. A replay must still be the first answer:
(a) an empty 201 with `content-type: application/json` keeps its content-type;
(b) a 204 keeps its status and headers;
(c) a body without content-type stays without one;
(d) HEAD (a rule with `methods: ["HEAD"]`): same status, `content-type` and `content-length`;
(e) gRPC (`content-type: application/grpc...`) with a key on a protected rule is refused before
    the upstream: HTTP 200, trailers-only, `grpc-status: 12` (UNIMPLEMENTED), a `grpc-message`,
    counter `grpc_refused`; the request never executes.
"""

from __future__ import annotations

import pytest

from harness import key_headers, new_key

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True},
        {"name": "head", "match": {"prefix": "/head", "methods": ["HEAD"]}, "require_key": True},
    ],
}

BODY = b'{"item":"book","qty":1}'

# Headers that legitimately differ between an answer and its replay:
# - date: the time of each answer (Envoy writes it on every response);
# - x-envoy-upstream-service-time: the router's timing of the upstream call, which a replay
#   does not make (whether the snapshot kept it or not, its value is not the replay's);
# - idempotent-replayed: the replay marker itself.
# Everything else must be equal, with multiplicity: content-type, content-length (none for a
# 204, RFC 9110 8.6), server (Envoy rewrites it to "envoy" on both), x-execution, set-cookie.
VOLATILE = {"date", "x-envoy-upstream-service-time", "idempotent-replayed"}


def _header_set(resp):
    return sorted((k.lower(), v) for k, v in resp.headers if k.lower() not in VOLATILE)


def test_empty_body_keeps_its_content_type(envoy, upstream):
    key = new_key()
    first = envoy.post("/orders", BODY, key_headers(key, x_content_type="application/json",
                                                 x_response_bytes="0"))
    assert first.status == 201 and first.body == b"", first
    assert first.header("content-type") == "application/json", first
    again = envoy.post("/orders", BODY, key_headers(key))
    assert again.status == 201 and again.replayed, again
    assert again.header("content-type") == "application/json", again
    assert again.body == b"" and again.header("content-length") == "0", again
    assert upstream.executions(key) == 1


def test_204_replays_with_the_same_headers(envoy, upstream):
    key = new_key()
    first = envoy.raw("POST", "/orders", list(key_headers(key, x_status="204").items()), BODY)
    assert first.status == 204 and first.body == b"" and not first.replayed, first
    assert first.header("content-type") == "application/json", first  # the upstream sent one
    again = envoy.raw("POST", "/orders", list(key_headers(key).items()), BODY)
    assert again.status == 204 and again.replayed and again.body == b"", again
    assert _header_set(again) == _header_set(first), "replay %r\nfirst  %r" % (
        _header_set(again), _header_set(first))
    assert upstream.executions(key) == 1


def test_body_without_content_type_stays_without(envoy, upstream):
    key = new_key()
    first = envoy.post("/orders", BODY, key_headers(key, x_no_content_type="1"))
    assert first.status == 201 and first.body and first.header("content-type") is None, first
    again = envoy.post("/orders", BODY, key_headers(key))
    assert again.status == 201 and again.replayed, again
    assert again.header("content-type") is None, again
    assert again.body == first.body
    assert upstream.executions(key) == 1


def test_head_replays_status_content_type_and_length(envoy, upstream):
    key = new_key()
    first = envoy.raw("HEAD", "/head/orders", [("idempotency-key", key)])
    assert first.status == 201 and not first.replayed, first
    length = first.header("content-length")
    assert first.header("content-type") == "application/json" and int(length) > 0, first
    again = envoy.raw("HEAD", "/head/orders", [("idempotency-key", key)])
    assert again.replayed, again
    assert again.status == first.status, again
    assert again.header("content-type") == "application/json", again
    assert again.header("content-length") == length, again
    assert again.header("x-execution") == first.header("x-execution"), again
    assert again.body == b""
    assert upstream.executions(key) == 1


# a gRPC request message: the 5-byte frame prefix (uncompressed, length 3) and 3 bytes of body
GRPC_FRAME = b"\x00\x00\x00\x00\x03\x08\x96\x01"


@pytest.mark.parametrize("ctype", ["application/grpc", "application/grpc+proto"])
def test_grpc_with_a_key_is_refused_never_executed(envoy, upstream, ctype):
    key = new_key()
    refused = envoy.idem("grpc_refused")
    headers = [("content-type", ctype), ("te", "trailers"), ("idempotency-key", key)]
    for _ in range(2):
        r = envoy.raw("POST", "/orders/Create", headers, GRPC_FRAME)
        assert r.status == 200, r
        assert r.header("content-type") is not None and r.header("content-type").startswith(
            "application/grpc"), r
        # trailers-only: grpc-status and grpc-message in the (only) header block, no body
        assert r.header("grpc-status") == "12", r
        assert r.header("grpc-message"), r
        assert r.body == b"", r
        assert not r.replayed, r
    envoy.wait_counter("grpc_refused", refused + 2)
    assert upstream.executions(key) == 0
