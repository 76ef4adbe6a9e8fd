"""C25: a claim lives as long as its owner. The lease (`processing_timeout`, 2 s here) is shorter
than the upstream (5 s; on etcd 9 s, past what a claim's lease key lived before renewals: its
lease, its completion's retry window and slack, 6 s) under a route timeout that lets the request
wait (12 s), with the client still connected: a retry past the lease gets 409 `request-in-flight`, whatever the rule says of a
lease that ended (`takeover` would execute again, `refuse` would answer 502, `reconcile` would
ask the upstream's lookup), because the request's Envoy renews its claim while it waits. Once
the 201 is in, every retry replays it: one execution. With `reconcile` and a lookup that answers
404 until the execution commits (what the demo's own lookup did), no lookup is made before the
commit. An owner that ends without an outcome (its client gone) lets its claim go: the claim
ends within a lease of its last renewal, and a `takeover` retry then executes again. Both
stores, and across two Envoys on one etcd."""

from __future__ import annotations

import threading
import time

import pytest

import harness
from harness import assert_problem, build_request, key_headers, new_key

BODY = b'{"order":42,"amount":"19.99"}'
LEASE = "2s"
# How long the upstream takes, and when retries come (seconds after the original): past the lease
# and, on etcd, past the lease key a claim had without renewals.
UPSTREAM = {"local": ("5000", (3.0, 4.2)), "etcd": ("9000", (3.0, 7.5))}
LOOKUP = {"path": "/_lookup/{key}", "timeout": "1s"}


def filter_config(store: dict) -> dict:
    rule = {"require_key": True, "processing_timeout": LEASE}
    return {
        "store": store,
        "routes": [
            dict(rule, name="orders", match={"prefix": "/orders"}, unknown_outcome="takeover"),
            dict(rule, name="pay", match={"prefix": "/pay"}, reconcile=LOOKUP),
            dict(rule, name="charges", match={"prefix": "/charges"}),  # refuse, the default
            dict(rule, name="held", match={"prefix": "/held"}, unknown_outcome="takeover",
                 concurrent="wait", wait_timeout="15s"),
        ],
    }


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    with harness.envoy_on_store(request.param, "renewal", envoy_bin, filter_wasm, upstream, filter_config,
                                route_timeout="12s") as proxy:
        proxy.kind = request.param
        yield proxy


def renewed(envoy) -> int:
    """Claims the Envoy renewed (`idempotency_claims_renewed_total`)."""
    return envoy.counter(harness.CLAIMS_RENEWED_STAT)


def _slow_original(envoy, path: str, key: str, kind: str) -> tuple[threading.Thread, list]:
    """The original request, its upstream taking 5 s (etcd: 9 s), its client waiting for it."""
    got: list = []

    def send():
        got.append(envoy.post(path, BODY, key_headers(key, x_delay_ms=UPSTREAM[kind][0]), timeout=20))

    thread = threading.Thread(target=send)
    thread.start()
    return thread, got


def _retries_in_flight_then_replay(original, retry_to, upstream, path, key, since, kind) -> None:
    thread, got = original
    # Past the lease (2 s) and well past it, while the upstream still works: 409, not another
    # execution, not a refusal, not a lookup.
    for at in UPSTREAM[kind][1]:
        time.sleep(max(0.0, since + at - time.monotonic()))
        assert_problem(retry_to.post(path, BODY, key_headers(key)), 409, "request-in-flight")
    assert upstream.lookups(key) == 0
    thread.join(20)
    (first,) = got
    assert first.status == 201 and not first.replayed, first
    again = retry_to.post(path, BODY, key_headers(key))
    assert again.status == 201 and again.replayed and again.body == first.body, again
    assert upstream.executions(key) == 1
    assert upstream.lookups(key) == 0


@pytest.mark.parametrize("path", ["/orders", "/charges"])
def test_a_retry_past_the_lease_of_a_request_still_at_work_gets_409_then_the_replay(envoy, upstream, path):
    key = new_key()
    since = time.monotonic()
    original = _slow_original(envoy, path, key, envoy.kind)
    _retries_in_flight_then_replay(original, envoy, upstream, path, key, since, envoy.kind)
    assert renewed(envoy) >= 1


def test_a_lookup_that_404s_until_the_commit_is_never_asked_while_the_original_runs(envoy, upstream):
    # The broken lookup the filter must survive: 404 while the execution runs (the demo's own
    # lookup answers 202 then, as docs/CONTRACT.md asks of upstream authors).
    upstream.lookup_while_running(404)
    try:
        key = new_key()
        since = time.monotonic()
        original = _slow_original(envoy, "/pay", key, envoy.kind)
        _retries_in_flight_then_replay(original, envoy, upstream, "/pay", key, since, envoy.kind)
    finally:
        upstream.lookup_while_running(202)


def test_a_waiter_past_the_lease_waits_for_the_original_and_gets_its_answer(envoy, upstream):
    key = new_key()
    thread, got = _slow_original(envoy, "/held", key, envoy.kind)
    time.sleep(0.5)
    # Held from 0.5 s, through the original's first lease and its renewals, to its answer.
    waited = envoy.post("/held", BODY, key_headers(key), timeout=20)
    thread.join(20)
    (first,) = got
    assert first.status == 201 and not first.replayed, first
    assert waited.status == 201 and waited.replayed and waited.body == first.body, waited
    assert upstream.executions(key) == 1


def test_an_owner_gone_without_an_outcome_lets_its_claim_end(envoy, upstream):
    key = new_key()
    data = build_request("POST", "/orders", list(key_headers(key, x_delay_ms="8000").items()), BODY)
    since = time.monotonic()
    # The client leaves at once: the stream ends without an outcome, nothing renews its claim.
    harness.leave_while_upstream_works(envoy.port, upstream, key, data)
    # The claim ends where its lease does (on etcd, after its lease key, by etcd's clock), and
    # the takeover rule then executes the retry: the claim did not outlive its owner.
    deadline = since + (3 if envoy.kind == "local" else 12)
    while True:
        resp = envoy.post("/orders", BODY, key_headers(key))
        if resp.status != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert resp.status == 201 and not resp.replayed, resp
    assert upstream.executions(key) == 2


@pytest.fixture(scope="module")
def fleet(envoy_bin, filter_wasm, upstream):
    etcd = harness.Etcd("etcd-renewal-fleet").start()
    store = harness.etcd_store(prefix="/e2e-renewal-fleet/")
    proxies = [
        harness.Envoy(envoy_bin, upstream.port, filter_config(store), wasm_path=filter_wasm,
                      name="renewal-fleet-%s" % n, route_timeout="12s",
                      extra_clusters=[harness.etcd_cluster([etcd.client_port])]).start()
        for n in ("a", "b")
    ]
    yield proxies
    for proxy in proxies:
        proxy.stop()
    etcd.stop()


@pytest.mark.parametrize("path", ["/orders", "/pay", "/charges"])
def test_on_another_envoy_of_the_fleet_a_retry_past_the_lease_gets_409_then_the_replay(fleet, upstream, path):
    a, b = fleet
    upstream.lookup_while_running(404)
    try:
        key = new_key()
        since = time.monotonic()
        original = _slow_original(a, path, key, "etcd")
        _retries_in_flight_then_replay(original, b, upstream, path, key, since, "etcd")
    finally:
        upstream.lookup_while_running(202)
