"""C8, C9, C15: what happens to a record for each kind of upstream outcome (a stored status
replays, a released one executes again), and what a replay looks like. Also:
- a response whose status the upstream already sent (201) but whose body was cut (upstream reset
  mid-body, client gone mid-download) is a known answer: a retry gets 410 `response-not-stored`
  with `idempotent-original-status`, never 409 and never a second execution, not even after the
  lease (`/short-lease`, processing_timeout 3s) has passed;
- 401, 403 and 409 from the upstream mean "did not execute": released by default."""

from __future__ import annotations

import json
import time

import pytest

import harness
from harness import assert_problem, build_request, expected_body, key_headers, new_key, sha256

MAX_RESPONSE = 65536
LEASE_S = 3  # above the 1 s Envoy takes to close a connection whose response was cut

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 10000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
         "max_response_bytes": MAX_RESPONSE},
        {"name": "unreachable", "match": {"prefix": "/unreachable"}, "require_key": True},
        # a short lease: after it, a takeover rule lets a retry take over an unknown outcome
        {"name": "short-lease", "match": {"prefix": "/short-lease"}, "require_key": True,
         "max_response_bytes": MAX_RESPONSE, "processing_timeout": "%ds" % LEASE_S},
    ],
}

BODY = b'{"item":"book","qty":1}'
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
              "proxy-authenticate", "proxy-authorization"}


def _post(envoy, key, path="/orders", **extra):
    return envoy.post(path, BODY, key_headers(key, **extra))


def test_2xx_is_stored_and_replayed_as_a_snapshot(envoy, upstream):
    key = new_key()
    claimed, stored, replayed = (envoy.idem(o) for o in ("claimed", "stored", "replayed"))
    first = _post(envoy, key)
    assert first.status == 201 and not first.replayed, first
    assert first.header("idempotent-replayed") is None

    again = _post(envoy, key)
    assert again.status == 201, again
    assert again.header("idempotent-replayed") == "true"
    for name in ("content-type", "x-execution"):
        assert again.header(name) == first.header(name), name
    assert again.header_all("set-cookie") == first.header_all("set-cookie") == [
        "session=" + first.header("x-execution")]
    assert again.body == first.body
    assert json.loads(again.body)["order_id"] == int(first.header("x-execution"))
    assert not HOP_BY_HOP & {k.lower() for k, _ in again.headers}, again.headers
    assert len(again.header_all("content-length")) <= 1
    assert upstream.executions(key) == 1

    envoy.wait_counter("claimed", claimed + 1)
    envoy.wait_counter("stored", stored + 1)
    envoy.wait_counter("replayed", replayed + 1)


def test_replay_over_raw_http(envoy, upstream):
    key = new_key()
    first = envoy.raw("POST", "/orders", [("content-type", "application/json"),
                                          ("idempotency-key", key)], BODY)
    again = envoy.raw("POST", "/orders", [("content-type", "application/json"),
                                          ("idempotency-key", key)], BODY)
    assert first.complete and again.complete
    assert again.replayed and again.body == first.body, again
    assert not HOP_BY_HOP & {k.lower() for k, _ in again.headers}, again.headers


@pytest.mark.parametrize("status", [200, 202, 302])
def test_2xx_and_3xx_are_stored(envoy, upstream, status):
    key = new_key()
    first = _post(envoy, key, x_status=str(status))
    assert first.status == status and not first.replayed, first
    again = _post(envoy, key)  # no knob: only a replay can answer `status`
    assert again.status == status and again.replayed, again
    assert again.body == first.body
    assert upstream.executions(key) == 1


@pytest.mark.parametrize("status", [400, 404, 422])
def test_final_4xx_is_stored_and_replayed(envoy, upstream, status):
    key = new_key()
    first = _post(envoy, key, x_status=str(status))
    assert first.status == status and not first.replayed, first
    again = _post(envoy, key)
    assert again.status == status and again.replayed, again
    assert again.body == first.body
    assert again.header("x-execution") == first.header("x-execution")
    assert upstream.executions(key) == 1


def _released_then_executed_again(envoy, upstream, status):
    """A first answer `status` releases the key: the retry executes again (201) and that
    second execution is the one kept and replayed."""
    key = new_key()
    released = envoy.idem("released")
    first = _post(envoy, key, x_status=str(status))
    assert first.status == status and not first.replayed, first
    envoy.wait_counter("released", released + 1)
    again = _post(envoy, key)
    assert again.status == 201 and not again.replayed, again
    assert upstream.executions(key) == 2
    third = _post(envoy, key)
    assert third.replayed and third.header("x-execution") == again.header("x-execution"), third


@pytest.mark.parametrize("status", [401, 403, 409])
def test_did_not_execute_statuses_release_the_key(envoy, upstream, status):
    # 401/403 (the upstream refused the caller) and 409 (the upstream refused a conflicting
    # state) say the operation did not run: a retry must execute again, not replay the refusal.
    _released_then_executed_again(envoy, upstream, status)


@pytest.mark.parametrize("status", [500, 502, 503, 408, 425, 429])
def test_retryable_statuses_release_the_key(envoy, upstream, status):
    _released_then_executed_again(envoy, upstream, status)


def test_upstream_never_reached_releases_the_key(envoy, upstream):
    key = new_key()
    released = envoy.idem("released")
    path = "/unreachable/" + key
    first = _post(envoy, key, path=path)
    assert first.status == 503 and not first.replayed, first
    again = _post(envoy, key, path=path)
    # forwarded again (Envoy's own 503 once more), not held as in flight, not replayed
    assert again.status == 503 and not again.replayed, again
    assert again.header("content-type") != "application/problem+json"
    envoy.wait_counter("released", released + 2)
    assert upstream.executions(key) == 0


def test_trailers_response_is_stored(envoy, upstream):
    key = new_key()
    hdrs = [("content-type", "application/json"), ("idempotency-key", key),
            ("x-trailers", "1"), ("x-response-bytes", "3000")]
    first = envoy.raw("POST", "/orders", hdrs, BODY)
    assert first.status == 201 and first.complete, first
    assert first.body == expected_body(int(first.header("x-execution")), 3000)
    assert first.trailer("x-checksum") == "sha256=" + sha256(first.body)
    again = envoy.raw("POST", "/orders", hdrs[:2], BODY)
    assert again.status == 201 and again.replayed and again.complete, again
    assert again.body == first.body
    assert upstream.executions(key) == 1


def test_chunked_response_is_stored(envoy, upstream):
    key = new_key()
    first = _post(envoy, key, x_chunked="1", x_response_bytes="10000")
    assert first.status == 201 and len(first.body) == 10000, first
    again = _post(envoy, key)
    assert again.replayed and again.body == first.body, again
    assert upstream.executions(key) == 1


def test_response_just_under_the_limit_is_stored(envoy, upstream):
    key = new_key()
    size = MAX_RESPONSE - 1024
    first = _post(envoy, key, x_response_bytes=str(size))
    assert first.body == expected_body(int(first.header("x-execution")), size)
    again = _post(envoy, key)
    assert again.replayed and again.body == first.body, again
    assert again.header("content-type") == "application/octet-stream"


def test_response_over_the_limit_is_delivered_but_not_stored(envoy, upstream):
    key = new_key()
    not_stored = envoy.idem("response_not_stored")
    size = 4 * MAX_RESPONSE + 123
    first = _post(envoy, key, x_response_bytes=str(size))
    assert first.status == 201 and not first.replayed, first
    assert first.body == expected_body(int(first.header("x-execution")), size)  # untouched

    for _ in range(2):
        r = _post(envoy, key)
        assert_problem(r, 410, "response-not-stored")
        assert r.header("idempotent-original-status") == "201"
    assert upstream.executions(key) == 1
    envoy.wait_counter("response_not_stored", not_stored + 1)


def test_response_over_the_limit_with_trailers(envoy, upstream):
    key = new_key()
    size = 2 * MAX_RESPONSE
    hdrs = [("content-type", "application/json"), ("idempotency-key", key),
            ("x-trailers", "1"), ("x-response-bytes", str(size))]
    first = envoy.raw("POST", "/orders", hdrs, BODY)
    assert first.status == 201 and first.complete, first
    assert first.body == expected_body(int(first.header("x-execution")), size)
    r = _post(envoy, key)
    assert_problem(r, 410, "response-not-stored")
    assert upstream.executions(key) == 1


def test_upstream_reset_before_headers_is_an_unknown_outcome(envoy, upstream):
    # The upstream got the request and dropped the connection: it may have executed, so the
    # outcome is unknown (never a stored 503, never released): by default the record is
    # completed as such, and a retry gets 502 outcome-unknown, never a second execution.
    key = new_key()
    unknown = envoy.idem("outcome_unknown")
    first = _post(envoy, key, x_reset="before-headers")
    assert first.status == 503 and not first.replayed, first
    envoy.wait_counter("outcome_unknown", unknown + 1)
    assert_problem(_post(envoy, key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1


def _past_the_lease(since: float) -> None:
    """Sleep until the short lease of a claim made at `since` (monotonic) has surely ended: after
    it, a filter that still saw the outcome as unknown would let a retry take over."""
    remaining = since + LEASE_S + 0.5 - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


def _assert_not_stored_201(resp):
    assert_problem(resp, 410, "response-not-stored")
    assert resp.header("idempotent-original-status") == "201", resp


def test_upstream_reset_mid_body_is_never_executed_again(envoy, upstream):
    # The upstream sent 201 and its headers, then reset in the middle of the body: it executed.
    # The truncated body is never stored (a truncated replay would be worse than none), but the
    # answer is known, so a retry gets 410 with the original status, during and after the lease.
    key = new_key()
    hdrs = [("content-type", "application/json"), ("idempotency-key", key),
            ("x-reset", "mid-body"), ("x-response-bytes", "20000")]
    since = time.monotonic()
    first = envoy.raw("POST", "/short-lease", hdrs, BODY)
    assert first.status == 201 and not first.complete, first
    envoy.wait_idle()
    _assert_not_stored_201(_post(envoy, key, path="/short-lease"))
    _past_the_lease(since)
    _assert_not_stored_201(_post(envoy, key, path="/short-lease"))
    assert upstream.executions(key) == 1

def test_client_gone_while_the_upstream_works_is_an_unknown_outcome(envoy, upstream):
    key = new_key()
    unknown = envoy.idem("outcome_unknown")
    data = build_request("POST", "/orders", [("content-type", "application/json"),
                                             ("idempotency-key", key),
                                             ("x-delay-ms", "1000")], BODY)
    harness.leave_while_upstream_works(envoy.port, upstream, key, data)
    envoy.wait_counter("outcome_unknown", unknown + 1)
    assert_problem(_post(envoy, key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1


def test_client_gone_mid_request_body_claims_nothing(envoy, upstream):
    key = new_key()
    partial = build_request("POST", "/orders", [("content-type", "application/json"),
                                                ("idempotency-key", key),
                                                ("content-length", "1000")]) + b"{" + b" " * 99
    harness.send_and_disconnect(envoy.port, partial)
    r = _post(envoy, key)
    assert r.status == 201 and not r.replayed, r
    assert upstream.executions(key) == 1


def test_client_gone_mid_response_never_gives_a_truncated_replay(envoy, upstream):
    # The client leaves after 2000 bytes of a response the upstream sends at once: Envoy may or
    # may not have had all of it. Either the whole response is replayed, or 410 with the original
    # status; never 409, never a second execution, not even after the lease.
    key = new_key()
    size = MAX_RESPONSE - 4096
    data = build_request("POST", "/short-lease", [("content-type", "application/json"),
                                                  ("idempotency-key", key),
                                                  ("x-response-bytes", str(size))], BODY)
    since = time.monotonic()
    got = harness.read_partial_and_disconnect(envoy.port, data, 2000)
    assert got.startswith(b"HTTP/1.1 201"), got[:200]
    assert upstream.executions(key) == 1
    _past_the_lease(since)
    again = _post(envoy, key, path="/short-lease")
    if again.replayed:
        # whatever was stored is the whole response of the one execution
        n = upstream.requests(key)[0]["n"]
        assert again.status == 201, again
        assert again.header("x-execution") == str(n)
        assert again.body == expected_body(n, size)
    else:
        _assert_not_stored_201(again)
    assert upstream.executions(key) == 1


def test_client_gone_mid_download_is_never_executed_again(envoy, upstream):
    # The upstream sends 201, its headers and half the body, then pauses; the client reads a
    # little and goes away. Envoy never has the whole response, so nothing can be stored, but
    # the upstream executed: a retry gets 410 with the original status, even after the lease.
    key = new_key()
    data = build_request("POST", "/short-lease", [("content-type", "application/json"),
                                                  ("idempotency-key", key),
                                                  ("x-response-bytes", "20000"),
                                                  ("x-body-pause-ms", "2000")], BODY)
    since = time.monotonic()
    got = harness.read_partial_and_disconnect(envoy.port, data, 2000)
    assert got.startswith(b"HTTP/1.1 201"), got[:200]
    assert upstream.executions(key) == 1
    envoy.wait_idle()
    _assert_not_stored_201(_post(envoy, key, path="/short-lease"))
    _past_the_lease(since)
    _assert_not_stored_201(_post(envoy, key, path="/short-lease"))
    assert upstream.executions(key) == 1
