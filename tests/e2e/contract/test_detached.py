"""C9, C20, C21: detached execution (`routes[].execution: "detached"`) against a real Envoy.

The 2 AM incident: a payment executes upstream, but its client never gets the answer (it gave
up, Envoy timed the stream out, the network dropped). Inline, Envoy resets the upstream request
with the stream and the answer is lost: every retry gets 502 outcome-unknown (on a takeover
rule, once the lease ends a retry executes the payment again). Detached, the worker's root makes
the upstream call itself: the answer is recorded whatever happens to the client, and every retry
is the replay.

Also: the happy path is unchanged for the client and the upstream (method, query, Host,
headers, body bytes; status, headers, body, JSON and a 256 KiB binary), `upstream_timeout`
answers within about that time and leaves no second execution (C20), a call Envoy refuses (a
cluster it does not know) gets 503 detached-capacity with the claim given back (C21), and a
waiter (wait mode) gets the replay of a detached call whose own client left.
"""

from __future__ import annotations

import hashlib
import threading
import time

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

LEASE_S = 3
UPSTREAM_TIMEOUT_S = 2


def _rule(name: str, prefix: str, **extra) -> dict:
    return harness.detached_rule(name, prefix, LEASE_S, UPSTREAM_TIMEOUT_S, **extra)


FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        _rule("pay", "/pay"),
        _rule("waitpay", "/waitpay", concurrent="wait", wait_timeout="10s"),
        # Envoy's own 504 after 1 s (the route's max_stream_duration) while the upstream works on.
        _rule("msd", "/msd"),
        # The harness routes /unreachable to a port that refuses connections.
        _rule("unreachable", "/unreachable"),
        # A cluster Envoy does not know: it refuses the detached call.
        _rule("nocluster", "/nocluster", cluster="no-such-cluster"),
        # A host that is gone: its connects time out (BLACKHOLE).
        _rule("gone", "/gone"),
        # Routes that rewrite: the detached rule says the same rewrite again; the inline one
        # needs nothing (the router applies the route's).
        _rule("rewritten", "/rw/", upstream_rewrite={"prefix_rewrite": "/v2/",
                                                     "host_rewrite_literal": "payments.internal"}),
        {"name": "rewritten-inline", "match": {"prefix": "/rwi/"}, "require_key": True},
        # A route whose rate limit (a filter after this one) allows one request an hour.
        _rule("limited", "/limited"),
    ],
}
ADDED = {"header": {"key": "x-route-added", "value": "1"}}
# Connects to this port time out (its accept queue is full) until the test opens it.
BLACKHOLE = harness.Blackhole()
ENVOY_OPTIONS = {
    "concurrency": 2,
    "extra_routes": [
        {"match": {"prefix": "/msd"},
         "route": {"cluster": "orders", "timeout": "10s",
                   "max_stream_duration": {"max_stream_duration": "1s"}}},
        {"match": {"prefix": "/gone"}, "route": {"cluster": "gone"}},
        {"match": {"prefix": "/rw/"}, "request_headers_to_add": [ADDED],
         "route": {"cluster": "orders", "prefix_rewrite": "/v2/", "host_rewrite_literal": "payments.internal"}},
        {"match": {"prefix": "/rwi/"}, "request_headers_to_add": [ADDED],
         "route": {"cluster": "orders", "prefix_rewrite": "/v2/", "host_rewrite_literal": "payments.internal"}},
        harness.route("/limited", per_filter=harness.local_ratelimit_route(1, "3600s")),
    ],
    "extra_clusters": [dict(harness.cluster("gone", BLACKHOLE.port), connect_timeout="0.5s")],
    "post_filters": [harness.local_ratelimit_filter()],
}

BODY = b'{"amount":4200,"currency":"EUR","card":"tok_visa"}'


def _post(envoy, path, key, timeout=15.0, **extra):
    return envoy.post(path, BODY, key_headers(key, **extra), timeout=timeout)


def _send_and_leave(envoy, upstream, path, key, delay_ms, **extra):
    """Sends a protected POST whose upstream takes `delay_ms`, waits until the upstream has
    it, then closes the connection (RST): the client is gone while the upstream works."""
    headers = key_headers(key, **{"x-delay-ms": str(delay_ms)}, **extra)
    harness.leave_while_upstream_works(envoy.port, upstream, key,
                                       harness.build_request("POST", path, headers, BODY))


def test_a_client_that_leaves_while_the_upstream_works_loses_nothing(envoy, upstream):
    key = new_key()
    stored = envoy.idem("stored")
    _send_and_leave(envoy, upstream, "/pay", key, 800)
    # The upstream finishes after the client left; the root records its answer.
    envoy.wait_counter("stored", stored + 1, timeout=5)
    retry = _post(envoy, "/pay", key)
    assert retry.status == 201 and retry.replayed, retry
    # And after the lease: still the replay, never a second execution.
    time.sleep(LEASE_S + 0.3)
    late = _post(envoy, "/pay", key)
    assert late.status == 201 and late.replayed, late
    assert late.body == retry.body
    assert upstream.executions(key) == 1


def test_envoys_own_504_while_the_upstream_finishes_later(envoy, upstream):
    key = new_key()
    t0 = time.monotonic()
    first = _post(envoy, "/msd", key, **{"x-delay-ms": "1500"})
    assert first.status == 504, first
    assert time.monotonic() - t0 < 1.4, "Envoy's max_stream_duration, not the upstream"
    harness.wait_until(lambda: _post(envoy, "/msd", key).status != 409, 5, interval=0.2,
                       what="the detached call's end")
    retry = _post(envoy, "/msd", key)
    assert retry.status == 201 and retry.replayed, retry
    assert upstream.executions(key) == 1


def test_a_waiter_gets_the_replay_of_a_call_whose_client_left(envoy, upstream):
    key = new_key()
    _send_and_leave(envoy, upstream, "/waitpay", key, 1200)
    t0 = time.monotonic()
    waiter = _post(envoy, "/waitpay", key)
    assert waiter.status == 201 and waiter.replayed, waiter
    assert time.monotonic() - t0 < 3, "woken when the detached call ended"
    assert upstream.executions(key) == 1


def test_upstream_timeout_answers_in_time_and_never_executes_twice(envoy, upstream):
    key = new_key()
    t0 = time.monotonic()
    first = _post(envoy, "/pay", key, **{"x-delay-ms": "4000"})
    elapsed = time.monotonic() - t0
    problem = assert_problem(first, 504, "outcome-unknown")
    assert "unknown" in problem["detail"]
    assert UPSTREAM_TIMEOUT_S - 0.2 <= elapsed < UPSTREAM_TIMEOUT_S + 1.5, elapsed
    # By default (unknown_outcome: refuse) never executed again: 502 outcome-unknown, now and
    # after the lease.
    assert_problem(_post(envoy, "/pay", key), 502, "outcome-unknown")
    time.sleep(max(0.0, t0 + LEASE_S + 0.5 - time.monotonic()))
    assert_problem(_post(envoy, "/pay", key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1


def test_the_happy_path_is_unchanged_for_client_and_upstream(envoy, upstream):
    key = new_key()
    headers = key_headers(key, **{"x-custom": "a b", "host": "shop.example"})
    first = envoy.post("/pay?x=1&y=%C3%A9", BODY, headers)
    assert first.status == 201 and not first.replayed, first
    assert first.header("content-type") == "application/json"
    assert first.header("x-execution") and first.header("set-cookie")
    (seen,) = upstream.requests(key)
    assert seen["method"] == "POST" and seen["path"] == "/pay?x=1&y=%C3%A9"
    assert seen["body_sha256"] == hashlib.sha256(BODY).hexdigest()
    received = dict((k, v) for k, v in seen["headers"])
    assert received["host"] == "shop.example"
    assert received["x-custom"] == "a b"
    assert received["idempotency-key"] == key
    retry = envoy.post("/pay?x=1&y=%C3%A9", BODY, headers)
    assert retry.status == 201 and retry.replayed
    assert retry.body == first.body
    assert retry.header("x-execution") == first.header("x-execution")
    # A 256 KiB binary body, byte for byte, the first time and replayed.
    key = new_key()
    size = 256 * 1024
    extra = {"x-response-bytes": str(size), "x-content-type": "application/octet-stream"}
    first = _post(envoy, "/pay", key, **extra)
    assert first.status == 201 and not first.replayed
    n = int(first.header("x-execution"))
    assert first.body == harness.expected_body(n, size)
    assert first.header("content-type") == "application/octet-stream"
    retry = _post(envoy, "/pay", key, **extra)
    assert retry.replayed and retry.body == first.body
    assert upstream.executions(key) == 1


def test_concurrent_new_keys_each_execute_once(envoy, upstream):
    keys = [new_key() for _ in range(16)]
    results = {}

    def call(k):
        results[k] = _post(envoy, "/pay", k)

    threads = [threading.Thread(target=call, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(results[k].status == 201 and not results[k].replayed for k in keys), results
    assert all(upstream.executions(k) == 1 for k in keys)


def test_an_upstream_reset_after_the_request_was_sent_is_an_unknown_outcome(envoy, upstream):
    """The upstream read the request (it executed) and dropped the connection without an answer.
    Envoy answers the callout with its own 503: that is no upstream answer, and releasing the
    claim would let the retry execute again."""
    key = new_key()
    first = _post(envoy, "/pay", key, **{"x-reset": "before-headers"})
    assert first.status in (502, 503, 504), first
    assert upstream.executions(key) == 1
    assert_problem(_post(envoy, "/pay", key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1


def test_an_upstream_that_cannot_be_reached_is_released(envoy, upstream):
    """Nothing was sent (connection refused): the claim is given back and a retry executes."""
    key = new_key()
    first = envoy.post("/unreachable/pay", BODY, key_headers(key))
    assert first.status == 503, first
    retry = envoy.post("/unreachable/pay", BODY, key_headers(key))
    assert retry.status == 503 and not retry.replayed, retry


def test_a_call_envoy_refuses_gets_503_detached_capacity_and_its_claim_back(envoy, upstream):
    """C21: Envoy refuses the detached call (a cluster it does not know): 503 detached-capacity
    with `retry-after: 1`, nothing sent upstream, and the claim given back (a retry gets the same
    503, never 409 request-in-flight)."""
    key = new_key()
    refused, released = envoy.idem("detached_refused"), envoy.idem("released")
    for _ in range(2):
        resp = envoy.post("/nocluster/pay", BODY, key_headers(key))
        assert_problem(resp, 503, "detached-capacity")
        assert retry_after_seconds(resp) == 1, resp
    assert upstream.executions(key) == 0
    envoy.wait_counter("detached_refused", refused + 2, timeout=5)
    envoy.wait_counter("released", released + 2, timeout=5)


def test_a_cluster_envoy_does_not_know_is_said_once_per_worker_naming_its_field_and_counted(envoy, upstream):
    """C21: the refusal of a cluster Envoy does not know is counted every time
    (`unknown_cluster_calls_total`) and said in one critical line per worker, naming the rule's
    field and the cluster, never once per request."""
    before = envoy.counter(harness.UNKNOWN_CLUSTER_STAT)
    for _ in range(6):
        assert_problem(envoy.post("/nocluster/pay", BODY, key_headers(new_key())), 503, "detached-capacity")
    harness.wait_until(lambda: envoy.counter(harness.UNKNOWN_CLUSTER_STAT) == before + 6, 5,
                       what="every refusal counted")
    lines = [line for line in envoy.log_text().splitlines()
             if "[critical]" in line and "Envoy does not know the cluster" in line]
    assert 1 <= len(lines) <= ENVOY_OPTIONS["concurrency"], lines
    for line in lines:
        assert 'routes[4].cluster: Envoy does not know the cluster "no-such-cluster"' in line, line
        assert "every new key on this rule gets 503 detached-capacity" in line, line


def test_a_host_whose_connects_time_out_is_never_sent_to_and_the_claim_released(envoy, upstream):
    """Issue 30: Envoy's pool gave up connecting (`reset reason: connection timeout`): nothing
    was sent, so the claim is released, not burnt as an unknown outcome. Once the host is back
    the retry executes, once."""
    key = new_key()
    released, unknown = envoy.idem("released"), envoy.idem("outcome_unknown")
    first = envoy.post("/gone/pay", BODY, key_headers(key))
    assert first.status == 503, first
    assert b"connection timeout" in first.body, first
    envoy.wait_counter("released", released + 1, timeout=5)
    assert envoy.idem("outcome_unknown") == unknown
    BLACKHOLE.open(upstream.port)
    retry = envoy.post("/gone/pay", BODY, key_headers(key))
    assert retry.status == 201 and not retry.replayed, retry
    assert upstream.executions(key) == 1
    again = envoy.post("/gone/pay", BODY, key_headers(key))
    assert again.status == 201 and again.replayed, again


def test_a_201_cut_mid_body_is_an_unknown_outcome_where_inline_keeps_the_status(envoy, upstream):
    """A difference from inline (docs/CONTRACT.md, Detached execution): Envoy's async client
    reports an answer reset after its headers as a failed call with no `:status`
    (`Context::onHttpCallFailure`), so the 201 is lost. Inline the retry gets 410 with
    `idempotent-original-status: 201` (C15); detached, the outcome is unknown, and by default
    never executed again."""
    key = new_key()
    first = _post(envoy, "/pay", key, **{"x-reset": "mid-body"})
    assert_problem(first, 502, "outcome-unknown")
    assert_problem(_post(envoy, "/pay", key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1


def test_the_routes_rewrite_reaches_the_upstream_said_once_more_on_the_rule(envoy, upstream):
    """Issue 30: a detached call is a callout, so the route's `prefix_rewrite` and
    `host_rewrite_literal` never apply to it; the rule's `upstream_rewrite` says them again, and
    the upstream gets the path and Host the inline route sends. What the route adds
    (`request_headers_to_add`) a detached call does not get, and Envoy adds its own
    `x-envoy-expected-rq-timeout-ms` (upstream_timeout) to it."""
    seen = {}
    for prefix in ("/rw/", "/rwi/"):
        key = new_key()
        resp = envoy.post(prefix + "pay?x=1", BODY, key_headers(key, host="shop.example"))
        assert resp.status == 201, resp
        (request,) = upstream.requests(key)
        seen[prefix] = (request["path"], dict(request["headers"]))
    assert seen["/rw/"][0] == seen["/rwi/"][0] == "/v2/pay?x=1", seen
    assert seen["/rw/"][1]["host"] == seen["/rwi/"][1]["host"] == "payments.internal", seen
    assert seen["/rwi/"][1].get("x-route-added") == "1" and "x-route-added" not in seen["/rw/"][1]
    assert seen["/rw/"][1].get("x-envoy-expected-rq-timeout-ms") == str(UPSTREAM_TIMEOUT_S * 1000)


def test_the_filters_after_this_one_never_see_a_detached_call(envoy, upstream):
    """A rate limit placed after the filter allows one request an hour on /limited (inline its
    second request gets 429: test_local_replies.py); a detached call never passes it."""
    for _ in range(2):
        key = new_key()
        resp = envoy.post("/limited/pay", BODY, key_headers(key))
        assert resp.status == 201 and not resp.replayed, resp
        assert upstream.executions(key) == 1


def test_an_answer_with_trailers_is_sent_and_stored_without_them(envoy, upstream):
    key = new_key()
    first = _post(envoy, "/pay", key, **{"x-trailers": "1"})
    assert first.status == 201 and first.header("x-checksum") is None, first
    retry = _post(envoy, "/pay", key, **{"x-trailers": "1"})
    assert retry.status == 201 and retry.replayed and retry.body == first.body, retry
    assert upstream.executions(key) == 1


def test_an_answer_over_the_async_clients_32_mib_is_an_unknown_outcome(envoy, upstream):
    """Envoy's async client refuses an answer over 32 MiB as a failed call, after the upstream
    executed: 502 outcome-unknown, never executed again."""
    key = new_key()
    first = _post(envoy, "/pay", key, **{"x-response-bytes": str(32 * 1024 * 1024 + 1)})
    assert_problem(first, 502, "outcome-unknown")
    assert_problem(_post(envoy, "/pay", key), 502, "outcome-unknown")
    assert upstream.executions(key) == 1
