"""C9 behind Envoy's own retries: retries under one claim are counted and warned about, and the
client's retry replays.

The Envoy route `/retried` retries 5xx (`retry_on: 5xx`, `num_retries: 2`) in front of the
protected rule `retried-orders`. With `x-fail-first: 503` the upstream executes twice under the
one claim (503, then 201): the client sees 201, the counter `upstream_retried` counts the
request (the filter reads the upstream attempt count), a retry with the same key replays, and
the filter logs one warning naming the rule (Envoy retries can execute a request twice; the
filter cannot prevent it). concurrency 1: "once" is checked on one worker.
"""

from __future__ import annotations

import re

import harness
from harness import key_headers, new_key

RULE = "retried-orders"

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": RULE, "match": {"prefix": "/retried"}, "require_key": True}],
}
ENVOY_OPTIONS = {
    "concurrency": 1,
    "extra_routes": [harness.route("/retried", retry_policy={"retry_on": "5xx",
                                                             "num_retries": 2})],
}

BODY = b'{"item":"book","qty":1}'
# a line the filter logged at warning level (or above), not Envoy echoing anything
_FILTER_WARNING = re.compile(r"\]\[(warning|error|critical)\]\[wasm\].*wasm log")


def _post(envoy, key, **extra):
    headers = key_headers(key, **extra)
    return envoy.post("/retried", BODY, headers)


def _retry_warnings(envoy):
    return [l for l in envoy.log_text().splitlines()
            if _FILTER_WARNING.search(l) and "retry" in l.lower() and RULE in l]


def test_envoy_retry_under_one_claim_is_counted_and_replayed(envoy, upstream):
    key = new_key()
    retried = envoy.idem("upstream_retried")
    claimed = envoy.idem("claimed")
    first = _post(envoy, key, x_fail_first="503")
    assert first.status == 201 and not first.replayed, first
    assert upstream.executions(key) == 2  # Envoy's retry: 503, then 201
    envoy.wait_counter("upstream_retried", retried + 1)
    assert envoy.idem("claimed") == claimed + 1  # one claim for both attempts

    again = _post(envoy, key)
    assert again.status == 201 and again.replayed, again
    assert again.header("x-execution") == first.header("x-execution")
    assert upstream.executions(key) == 2


def test_a_request_without_retry_is_not_counted(envoy, upstream):
    key = new_key()
    retried = envoy.idem("upstream_retried")
    stored = envoy.idem("stored")
    first = _post(envoy, key)
    assert first.status == 201 and upstream.executions(key) == 1, first
    envoy.wait_counter("stored", stored + 1)
    # a retried request afterwards is counted, this one was not
    other = new_key()
    assert _post(envoy, other, x_fail_first="503").status == 201
    envoy.wait_counter("upstream_retried", retried + 1)
    assert envoy.idem("upstream_retried") == retried + 1


def test_the_route_warning_is_logged_once(envoy, upstream):
    retried = envoy.idem("upstream_retried")
    for _ in range(2):
        key = new_key()
        assert _post(envoy, key, x_fail_first="503").status == 201
        assert upstream.executions(key) == 2
    envoy.wait_counter("upstream_retried", retried + 2)
    lines = _retry_warnings(envoy)
    assert len(lines) == 1, lines
