"""C12: wait mode bounds. Past max_waiters_per_key a duplicate gets 409 at once and is counted."""

from __future__ import annotations

import threading

import harness
from harness import assert_problem, new_key

FILTER_CONFIG = {
    "max_waiters_per_key": 2,
    "max_waiters": 100,  # x 1 MiB bodies: inside the 256 MiB bound on held request bodies
    "routes": [{"name": "wait", "match": {"prefix": "/wait"}, "require_key": True,
                "concurrent": "wait", "wait_timeout": "10s"}],
}
ENVOY_OPTIONS = {"concurrency": 1}

BODY = b"{}"


def test_waiters_past_the_bound_get_409_at_once(envoy, upstream):
    key = new_key()
    headers = {"idempotency-key": key, "x-delay-ms": "1500"}
    threads = [threading.Thread(target=lambda: envoy.post("/wait", BODY, headers, timeout=30)) for _ in range(3)]
    threads[0].start()
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the original")
    for t in threads[1:]:
        t.start()
    harness.wait_until(lambda: envoy.idem("waiting") >= 2, 5, what="two held duplicates")
    refused_before = envoy.idem("wait_refused")
    r = envoy.post("/wait", BODY, headers, timeout=30)
    assert_problem(r, 409, "request-in-flight")
    assert envoy.idem("wait_refused") == refused_before + 1
    for t in threads:
        t.join(30)
    assert upstream.executions(key) == 1
