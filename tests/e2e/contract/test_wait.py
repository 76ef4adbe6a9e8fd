"""C11: wait mode. Duplicates that arrive while the original is processing are held and
answered with the original's result, across worker threads (--concurrency 4)."""

from __future__ import annotations

import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 10000},
    "max_waiters_per_key": 100,
    # x 1 MiB (default max_request_bytes) = 200 MiB of held bodies, inside the 256 MiB bound
    "max_waiters": 200,
    "routes": [
        {"name": "wait", "match": {"prefix": "/wait"}, "require_key": True,
         "concurrent": "wait", "wait_timeout": "10s"},
        {"name": "short", "match": {"prefix": "/short"}, "require_key": True,
         "concurrent": "wait", "wait_timeout": "1s"},
        {"name": "reject", "match": {"prefix": "/reject"}, "require_key": True},
    ],
}
ENVOY_OPTIONS = {"concurrency": 4}

BODY = b'{"item":"book","qty":1}'


def _parallel(envoy, n, path, headers, body=BODY, stagger=0.0):
    def one(i):
        if stagger:
            time.sleep(i * stagger)
        return envoy.post(path, body, headers, timeout=30)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def test_64_waiters_get_the_original_result(envoy, upstream):
    key = new_key()
    before = envoy.idem("waiting")
    responses = _parallel(envoy, 64, "/wait", key_headers(key, x_delay_ms="300"))
    assert upstream.executions(key) == 1
    assert all(r.status == 201 for r in responses), [r.status for r in responses]
    assert len({r.body for r in responses}) == 1, "every response carries the original's body"
    assert sum(1 for r in responses if r.replayed) == 63
    assert envoy.idem("waiting") > before, "duplicates were held, not refused"
    assert envoy.idem("in_flight") == 0


def test_reject_mode_answers_409_and_executes_once(envoy, upstream):
    key = new_key()
    responses = _parallel(envoy, 64, "/reject", key_headers(key, x_delay_ms="300"))
    assert upstream.executions(key) == 1
    statuses = [r.status for r in responses]
    assert all(s in (201, 409) for s in statuses), statuses
    assert sum(1 for r in responses if r.status == 201 and not r.replayed) == 1
    for r in responses:
        if r.status == 409:
            assert_problem(r, 409, "request-in-flight")


def test_released_original_lets_exactly_one_waiter_execute(envoy, upstream):
    key = new_key()
    released_before = envoy.idem("released")
    original = threading.Thread(target=lambda: results.append(
        envoy.post("/wait", BODY, key_headers(key, x_delay_ms="500", x_fail_first="503"), timeout=30)))
    results = []
    original.start()
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the original to reach the upstream")
    waiters = _parallel(envoy, 10, "/wait", key_headers(key, x_delay_ms="200", x_fail_first="503"))
    original.join(30)
    assert results and results[0].status == 503 and not results[0].replayed
    assert envoy.idem("released") == released_before + 1
    assert upstream.executions(key) == 2, "exactly one waiter executed after the release"
    assert all(r.status == 201 for r in waiters), [r.status for r in waiters]
    assert sum(1 for r in waiters if not r.replayed) == 1
    assert len({r.body for r in waiters}) == 1


def test_waiter_past_wait_timeout_gets_409(envoy, upstream):
    key = new_key()
    timed_out_before = envoy.idem("wait_timed_out")
    slow = threading.Thread(target=lambda: envoy.post("/short", BODY, key_headers(key, x_delay_ms="3000"), timeout=30))
    slow.start()
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the original to reach the upstream")
    started = time.monotonic()
    r = envoy.post("/short", BODY, key_headers(key), timeout=30)
    waited = time.monotonic() - started
    assert_problem(r, 409, "request-in-flight")
    retry_after_seconds(r)
    assert waited >= 0.9, "the waiter was held for wait_timeout before the 409"
    assert envoy.idem("wait_timed_out") == timed_out_before + 1
    slow.join(30)
    assert upstream.executions(key) == 1


def test_waiter_whose_client_leaves_leaves_nothing_behind(envoy, upstream):
    key = new_key()
    slow = threading.Thread(target=lambda: envoy.post("/wait", BODY, key_headers(key, x_delay_ms="1500"), timeout=30))
    slow.start()
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the original to reach the upstream")
    waiting_before = envoy.idem("waiting")
    data = harness.build_request("POST", "/wait", key_headers(key), BODY)
    with socket.create_connection(("127.0.0.1", envoy.port), timeout=5) as s:
        s.sendall(data)
        harness.wait_until(lambda: envoy.idem("waiting") == waiting_before + 1, 5, what="the duplicate to be held")
    # The client is gone. The original completes; nothing was executed for the dropped waiter,
    # no error was counted, and later retries replay normally.
    slow.join(30)
    r = envoy.post("/wait", BODY, key_headers(key), timeout=30)
    assert r.status == 201 and r.replayed
    assert upstream.executions(key) == 1
    assert envoy.idem("store_error") == 0
    assert "panicked" not in envoy.log_text()



def test_stress_2000_requests_over_200_keys(envoy, upstream):
    rng = random.Random(7)
    keys = [new_key() for _ in range(200)]
    plan = [rng.choice(keys) for _ in range(2000)]

    def one(key):
        time.sleep(rng.random() * 0.05)
        return key, envoy.post("/wait", BODY, key_headers(key, x_delay_ms=str(rng.randint(0, 80))), timeout=60)

    with ThreadPoolExecutor(max_workers=48) as pool:
        results = list(pool.map(one, plan))
    bodies = {}
    for key, r in results:
        assert r.status == 201, (key, r.status, r.body[:200])
        bodies.setdefault(key, set()).add(r.body)
    for key in set(plan):
        assert upstream.executions(key) == 1, key
        assert len(bodies[key]) == 1, key
