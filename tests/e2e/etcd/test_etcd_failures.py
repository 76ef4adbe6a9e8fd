"""C19: when etcd cannot be used: stopped (fail_closed answers 503 store-unavailable and forwards
nothing; fail_open forwards unprotected; both counted, and both recover when etcd is back
without restarting Envoy), and slower than the store's `timeout` (503, and the claim the late
write may have left behind is given back once etcd answers in time). The stopped and slow
cases run with both store protocols (JSON gateway, gRPC): how a failure reaches the filter
differs (an HTTP status, or a gRPC status in a trailers-only answer), and the log says Envoy
could not reach etcd either way."""

from __future__ import annotations

import threading
import time

import pytest

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

BODY = b'{"item":"book","qty":1}'
LEASE_S = 2
PAY_LEASE_S = 5


def filter_config(on_error: str, prefix: str, protocol: str = "json") -> dict:
    return {
        "store": harness.etcd_store(prefix=prefix, timeout="250ms", on_error=on_error, protocol=protocol),
        "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                    "processing_timeout": "%ds" % LEASE_S},
                   # The payment setting: an unknown outcome is never executed again.
                   {"name": "pay", "match": {"prefix": "/pay"}, "require_key": True,
                    "processing_timeout": "%ds" % PAY_LEASE_S, "unknown_outcome": "refuse"}],
    }


# Every Envoy of this module is built by its own fixture (the etcd ports come first).
FILTER_CONFIG = filter_config("fail_closed", "/e2e-failures/")


def proxy(envoy_bin, filter_wasm, upstream, port, on_error, name, prefix="/e2e-failures/", protocol="json",
          **options):
    return harness.Envoy(
        envoy_bin, upstream.port, filter_config(on_error, prefix, protocol), wasm_path=filter_wasm,
        name=f"{name}-{protocol}", extra_clusters=[harness.etcd_cluster([port], grpc=protocol == "grpc")],
        **options,
    ).start()


@pytest.fixture(params=["json", "grpc"])
def protocol(request) -> str:
    return request.param


@pytest.fixture
def both(envoy_bin, filter_wasm, upstream, etcd, protocol):
    closed = proxy(envoy_bin, filter_wasm, upstream, etcd.client_port, "fail_closed", "closed", protocol=protocol)
    opened = proxy(envoy_bin, filter_wasm, upstream, etcd.client_port, "fail_open", "open", protocol=protocol)
    yield closed, opened
    closed.stop()
    opened.stop()


def test_etcd_stopped_fail_closed_refuses_fail_open_forwards_and_both_recover(both, upstream, etcd):
    closed, opened = both
    # Both work while etcd runs.
    for p in both:
        assert p.post("/orders", BODY, key_headers(new_key())).status == 201
    etcd.stop(remove_data=False)
    try:
        errors, bypassed = closed.idem("store_error"), opened.idem("store_bypassed")
        key = new_key()
        resp = closed.post("/orders", BODY, key_headers(key))
        assert_problem(resp, 503, "store-unavailable")
        assert retry_after_seconds(resp) >= 1
        assert upstream.executions(key) == 0, "fail_closed forwards nothing"
        closed.wait_counter("store_error", errors + 1)
        # The log says what happened: Envoy answered for an etcd it could not reach, with its
        # status and its own words (a 503, over gRPC a trailers-only grpc-status 14); never
        # that etcd answered.
        said = [line for line in closed.log_text().splitlines() if "idempotency store error for" in line]
        assert said, "the store error is logged"
        assert all('Envoy could not reach etcd on cluster "etcd": the answer is Envoy\'s own, ' in line
                   for line in said), said
        assert not any("etcd answered" in line for line in said), said

        key = new_key()
        resp = opened.post("/orders", BODY, key_headers(key))
        assert resp.status == 201 and not resp.replayed
        # Unprotected: a retry executes again.
        assert opened.post("/orders", BODY, key_headers(key)).status == 201
        assert upstream.executions(key) == 2
        opened.wait_counter("store_bypassed", bypassed + 2)
        # Logged, but at most once a second per worker, not once per request.
        assert opened.log_text().count("forwarding requests unprotected") <= 2
    finally:
        etcd.spawn()
        etcd.wait_ready()
    # Back without restarting Envoy (the health check marks the member healthy again).
    for p in both:
        key = new_key()
        harness.wait_until(lambda: p.post("/orders", BODY, key_headers(key)).status == 201, 10,
                           interval=0.2, what="the store back on " + p.name)
        assert p.post("/orders", BODY, key_headers(key)).replayed


def test_etcd_slower_than_the_timeout_is_503_and_the_claim_it_left_is_given_back(
        envoy_bin, filter_wasm, upstream, etcd, protocol):
    """etcd gets the claim but its answer comes after `timeout`: 503, and nothing is forwarded.
    The claim that landed is nobody's, so the filter gives it back (by its owner token) as soon
    as etcd keeps time again: a retry then executes, once, long before the lease would have
    ended. On a rule that refuses unknown outcomes (the payment setting) the claim is never
    mistaken for one: before, the retry after the lease got 502 outcome-unknown for the whole
    ttl, for a payment that never ran."""
    delay = harness.DelayProxy(etcd.client_port, delay=0.0)
    # One worker: the first request leaves it the leases a claim names, so the call that times
    # out is the claim itself (a worker without them would read first, and claim nothing).
    slow = proxy(envoy_bin, filter_wasm, upstream, delay.port, "fail_closed", "slow",
                 prefix=f"/e2e-slow-{protocol}/", protocol=protocol, concurrency=1)
    try:
        assert slow.post("/pay", BODY, key_headers(new_key())).status == 201
        released = slow.idem("released")
        delay.delay = 0.6
        key = new_key()
        t0 = time.monotonic()
        resp = slow.post("/pay", BODY, key_headers(key))
        assert_problem(resp, 503, "store-unavailable")
        assert time.monotonic() - t0 < 2, "answered at the timeout, not when etcd answered"
        assert upstream.executions(key) == 0
        delay.delay = 0.0
        # The give-back is tried again until etcd takes it. Until then a retry gets 409 (the
        # claim is there); or 503 while etcd is still late: the proxy passes on what it already
        # held one chunk per old delay, and over gRPC every call shares that one connection.
        deadline = t0 + PAY_LEASE_S
        retry = slow.post("/pay", BODY, key_headers(key))
        while retry.status in (409, 503) and time.monotonic() < deadline:
            time.sleep(0.2)
            retry = slow.post("/pay", BODY, key_headers(key))
        assert retry.status == 201 and not retry.replayed, retry
        assert time.monotonic() < deadline, "executed only once the lease had ended"
        assert upstream.executions(key) == 1
        # Counted when a try of the give-back is answered: the try that landed may itself have
        # been answered late, and the next one comes after its backoff (up to 2 s), so the
        # count may follow the retry's execution by a few tries under load.
        slow.wait_counter("released", released + 1, timeout=15)
        assert slow.idem("unknown_refused") == 0
    finally:
        slow.stop()
        delay.close()


def test_an_etcd_whose_connects_time_out_is_a_store_failure_and_burns_no_key(
        envoy_bin, filter_wasm, upstream, etcd, protocol):
    """Issue 30: the store's callouts pass Envoy's connection pool as a detached call does. A
    connect that times out (etcd's host gone, its SYNs dropped) is a store failure: 503
    store-unavailable, nothing forwarded, and the key is not burnt as an unknown outcome (on the
    payment rule, which refuses them): once etcd can be reached the retry executes, once."""
    gone = harness.Blackhole()
    cluster = harness.etcd_cluster([gone.port], grpc=protocol == "grpc", health_checks=False)
    cluster["connect_timeout"] = "0.3s"
    config = filter_config("fail_closed", f"/e2e-gone-{protocol}/", protocol)
    config["store"]["timeout"] = "2s"
    proxy_ = harness.Envoy(envoy_bin, upstream.port, config, wasm_path=filter_wasm,
                           name=f"gone-{protocol}", extra_clusters=[cluster]).start()
    try:
        key = new_key()
        resp = proxy_.post("/pay", BODY, key_headers(key))
        assert_problem(resp, 503, "store-unavailable")
        assert upstream.executions(key) == 0
        gone.open(etcd.client_port)
        retry = proxy_.post("/pay", BODY, key_headers(key))
        assert retry.status == 201 and not retry.replayed, retry
        assert proxy_.post("/pay", BODY, key_headers(key)).replayed
        assert upstream.executions(key) == 1
        assert proxy_.idem("unknown_refused") == 0 and proxy_.idem("outcome_unknown") == 0
    finally:
        proxy_.stop()
        gone.close()


def test_a_claim_answered_after_the_client_left_is_released_at_once(
        envoy_bin, filter_wasm, upstream, etcd):
    """The client goes away while its claim is on its way to etcd (answers delayed, within
    the timeout): the root gets the claim for a stream that is gone and gives it back, so a
    retry executes at once instead of getting 409 until the lease ends."""
    delay = harness.DelayProxy(etcd.client_port, delay=0.0)
    slow = proxy(envoy_bin, filter_wasm, upstream, delay.port, "fail_closed", "gone",
                 prefix="/e2e-gone/")
    try:
        assert slow.post("/orders", BODY, key_headers(new_key())).status == 201
        released = slow.idem("released")
        delay.delay = 0.12
        key = new_key()
        data = harness.build_request("POST", "/orders", key_headers(key), BODY)
        harness.send_and_disconnect(slow.port, data)
        slow.wait_counter("released", released + 1)
        delay.delay = 0.0
        retry = slow.post("/orders", BODY, key_headers(key))
        assert retry.status == 201 and not retry.replayed, retry
        assert upstream.executions(key) == 1
    finally:
        slow.stop()
        delay.close()


def test_a_completion_etcd_answers_too_late_is_written_again_and_replayed_after_the_lease(
        envoy_bin, filter_wasm, upstream, etcd):
    """C9: the upstream answered 201 and the client got it, but etcd's answer to
    the completion came after `timeout`. The completion is tried again (it is guarded by the
    claim's revision), so a retry after the lease is the replay, not a second execution."""
    delay = harness.DelayProxy(etcd.client_port, delay=0.0)
    slow = proxy(envoy_bin, filter_wasm, upstream, delay.port, "fail_closed", "late-completion",
                 prefix="/e2e-late-completion/")
    try:
        assert slow.post("/orders", BODY, key_headers(new_key())).status == 201
        key = new_key()
        result = {}

        def call():
            result["first"] = slow.post("/orders", BODY, key_headers(key, **{"x-delay-ms": "700"}))

        client = threading.Thread(target=call)
        client.start()
        # The claim is written and the upstream runs: every etcd answer from now on is late.
        harness.wait_until(lambda: upstream.executions(key) == 1, 5, what="the execution")
        delay.delay = 0.6
        client.join(10)
        first = result["first"]
        assert first.status == 201 and not first.replayed, first
        delay.delay = 0.0
        time.sleep(LEASE_S + 0.3)
        retry = slow.post("/orders", BODY, key_headers(key, **{"x-delay-ms": "700"}))
        assert retry.status == 201 and retry.replayed, retry
        assert retry.body == first.body
        assert upstream.executions(key) == 1
        # Written by a later try (100 ms, doubling), counted once as stored.
        assert slow.idem("stored") == 2
        assert slow.idem("settlement_abandoned") == 0
    finally:
        slow.stop()
        delay.close()


def test_a_completion_tried_again_past_its_lease_is_never_taken_over_by_another_envoy(
        envoy_bin, filter_wasm, upstream, etcd):
    """C9, C13: the upstream answered within the lease and the client got 201, but its Envoy
    could not reach etcd to write the outcome (a network cut: nothing reaches etcd). It tries
    the completion again until its lease ended one processing_timeout ago, and the claim's
    lease key outlives that: another Envoy's retry after the lease gets 409, never a takeover
    that executes the payment again (the model checker's counterexample, docs/ETCD.md), and
    once the completion lands it replays. Before the fix the lease key ended a processing_timeout
    after the claim, while the owner was still trying."""
    lease_s = 8
    config = {
        "store": harness.etcd_store(prefix="/e2e-retried-completion/", timeout="250ms"),
        "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                    "processing_timeout": "%ds" % lease_s, "unknown_outcome": "takeover"}],
    }
    cut = harness.DelayProxy(etcd.client_port)
    owner = harness.Envoy(envoy_bin, upstream.port, config, wasm_path=filter_wasm, name="retried-owner", route_timeout="15s",
                          extra_clusters=[harness.etcd_cluster([cut.port])]).start()
    other = harness.Envoy(envoy_bin, upstream.port, config, wasm_path=filter_wasm, name="retried-other", route_timeout="15s",
                          extra_clusters=[harness.etcd_cluster([etcd.client_port])]).start()
    try:
        key, result = new_key(), {}
        started = time.monotonic()

        def call():
            # Answered 0.2 s before the lease ends.
            result["first"] = owner.post("/orders", BODY, key_headers(key, **{"x-delay-ms": "7800"}))

        client = threading.Thread(target=call)
        client.start()
        harness.wait_until(lambda: upstream.executions(key) == 1, 5, what="the execution")
        cut.cut()
        client.join(15)
        first = result["first"]
        assert first.status == 201 and not first.replayed, first
        # Past the end of a lease key that lived one processing_timeout (plus the 1 s reuse
        # window and 1 s of slack): about 10 s after the claim, while the owner still tries.
        time.sleep(max(0.0, started + 11.5 - time.monotonic()))
        assert owner.idem("stored") == 0 and owner.idem("settlement_abandoned") == 0
        retry = other.post("/orders", BODY, key_headers(key))
        assert_problem(retry, 409, "request-in-flight")
        assert upstream.executions(key) == 1
        # The owner's next try (every 2 s by now) reaches etcd and lands.
        cut.mend()
        harness.wait_until(lambda: owner.idem("stored", settle=False) == 1, 5, what="the completion")
        replay = other.post("/orders", BODY, key_headers(key))
        assert replay.status == 201 and replay.replayed, replay
        assert replay.body == first.body
        assert upstream.executions(key) == 1
        assert owner.idem("settlement_abandoned") == 0
    finally:
        owner.stop()
        other.stop()
        cut.close()
