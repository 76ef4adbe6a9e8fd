"""C10, C13, C8: a retry while the original runs gets 409 with an integer `retry-after` (C10);
parallel identical requests across workers execute once (C8); on a `takeover` rule a router
timeout keeps the record until its lease ends, then a retry takes it over (C13); problem replies
are never stored."""

from __future__ import annotations

import re
import threading

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 10000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
         "processing_timeout": "30s"},
        # A short lease. Envoy's route timeout for /leased is 0.5s (below), so an upstream that
        # takes longer makes the router answer 504: the outcome is unknown and, on this takeover
        # rule, the record must stay PROCESSING until the lease runs out.
        {"name": "leased", "match": {"prefix": "/leased"}, "require_key": True,
         "processing_timeout": "2s", "unknown_outcome": "takeover"},
    ],
}
ENVOY_OPTIONS = {
    "concurrency": 2,
    "extra_routes": [harness.route("/leased", timeout="0.5s")],
}

BODY = b'{"item":"book","qty":1}'


class Background(threading.Thread):
    """One request on its own connection, in a thread."""

    def __init__(self, envoy, path, headers, body=BODY):
        super().__init__(daemon=True)
        self.args = (path, body, headers)
        self.envoy = envoy
        self.response = None
        self.error = None
        self.start()

    def run(self):
        try:
            self.response = self.envoy.post(*self.args, timeout=30)
        except Exception as exc:  # noqa: BLE001 - reported by result()
            self.error = exc

    def result(self, timeout=30):
        self.join(timeout)
        assert not self.is_alive(), "background request still running"
        if self.error:
            raise self.error
        return self.response


def test_in_flight_is_409_and_the_original_is_replayed_after(envoy, upstream):
    key = new_key()
    in_flight_before = envoy.idem("in_flight")
    slow = Background(envoy, "/orders", key_headers(key, x_delay_ms="1500"))
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the upstream to get it")

    for _ in range(2):
        r = envoy.post("/orders", BODY, key_headers(key, x_delay_ms="1500"))
        assert_problem(r, 409, "request-in-flight")
        retry_after_seconds(r)

    original = slow.result()
    assert original.status == 201 and not original.replayed, original
    envoy.wait_counter("in_flight", in_flight_before + 2)

    # the 409s were not stored: the next retry replays the original 201
    again = envoy.post("/orders", BODY, key_headers(key))
    assert again.status == 201 and again.replayed, again
    assert again.header("x-execution") == original.header("x-execution")
    assert again.body == original.body
    assert upstream.executions(key) == 1


def _worker_connections(envoy):
    return envoy.stats(filter=r"^listener\.127\.0\.0\.1_\d+\.worker_\d+\.downstream_cx_total$")


def test_parallel_identical_requests_execute_once(envoy, upstream):
    key = new_key()
    n = 20
    workers_before = _worker_connections(envoy)
    claimed_before = envoy.idem("claimed")
    barrier = threading.Barrier(n)
    results = [None] * n

    def one(i):
        barrier.wait(10)
        # each thread uses its own connection, so the kernel spreads them over both workers
        results[i] = envoy.post("/orders", BODY, key_headers(key, x_delay_ms="500"), timeout=30)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results), results

    assert upstream.executions(key) == 1
    assert not [r for r in results if r.status >= 500], results
    fresh = [r for r in results if r.status == 201 and not r.replayed]
    replays = [r for r in results if r.replayed]
    conflicts = [r for r in results if r.status == 409]
    assert len(fresh) == 1, results
    assert len(fresh) + len(replays) + len(conflicts) == n, results
    for r in replays:
        assert r.status == 201 and r.body == fresh[0].body, r
    for r in conflicts:
        assert_problem(r, 409, "request-in-flight")
        retry_after_seconds(r)
    envoy.wait_counter("claimed", claimed_before + 1)
    assert envoy.idem("claimed") == claimed_before + 1

    # the requests really were spread over both workers (cross-worker claims)
    after = _worker_connections(envoy)
    grew = [k for k in after if after[k] > workers_before.get(k, 0)]
    assert len(grew) == 2, after

    # and afterwards everybody gets the one response
    again = envoy.post("/orders", BODY, key_headers(key))
    assert again.replayed and again.body == fresh[0].body, again


def test_router_timeout_keeps_the_record_then_the_lease_expires(envoy, upstream):
    key = new_key()
    path = "/leased/" + key
    taken_over_before = envoy.idem("taken_over")
    unknown_before = envoy.idem("kept_unknown")

    # The upstream takes 4s, Envoy gives up after 0.5s: 504, outcome unknown.
    timed_out = envoy.post(path, BODY, key_headers(key, x_delay_ms="4000"))
    assert timed_out.status == 504, timed_out
    assert upstream.executions(key) == 1
    envoy.wait_counter("kept_unknown", unknown_before + 1)

    # Within the 2s lease the record is still PROCESSING.
    r = envoy.post(path, BODY, key_headers(key))
    assert_problem(r, 409, "request-in-flight")
    retry_after_seconds(r)
    assert upstream.executions(key) == 1

    # Once the lease has passed, a retry takes the record over and executes.
    def takeover():
        resp = envoy.post(path, BODY, key_headers(key))
        if resp.status == 409:
            return None
        return resp

    taken = harness.wait_until(takeover, 10, 0.1, "the lease to expire")
    assert taken.status == 201 and not taken.replayed, taken
    assert upstream.executions(key) == 2
    envoy.wait_counter("taken_over", taken_over_before + 1)

    # ... and its response is what later retries get.
    again = envoy.post(path, BODY, key_headers(key))
    assert again.status == 201 and again.replayed, again
    assert again.header("x-execution") == taken.header("x-execution")
    assert upstream.executions(key) == 2


def test_retry_after_is_an_integer_number_of_seconds(envoy, upstream):
    key = new_key()
    slow = Background(envoy, "/orders", key_headers(key, x_delay_ms="1000"))
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the upstream to get it")
    r = envoy.post("/orders", BODY, key_headers(key))
    assert_problem(r, 409, "request-in-flight")
    value = r.header("retry-after")
    assert re.fullmatch(r"[1-9][0-9]*", value), value
    assert slow.result().status == 201
