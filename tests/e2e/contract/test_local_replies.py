"""C8 after a local reply: one from a filter or route after this filter releases the claim, so the
retry is forwarded as a first request.

- `/direct`: an Envoy `direct_response` route (201, no cluster) on the protected rule `direct`.
  Nothing reached an upstream, so the claim is released (`released`): a retry with the same key
  gets the direct response again (not a replay, not 409 `request-in-flight`).
- `/limited`: an `envoy.filters.http.local_ratelimit` placed after the filter (`post_filters`),
  one token per 2 s on that route only. Its local 429 releases the claim: the retry after the
  bucket refills is forwarded, not 409.

(Before the claim was released, it stayed PROCESSING for its lease, 30 s, and the retry got 409.)
"""

from __future__ import annotations

import time

import harness
from harness import new_key

FILL_S = 2
DIRECT_BODY = '{"direct":true}'

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "direct", "match": {"prefix": "/direct"}, "require_key": True},
        {"name": "limited", "match": {"prefix": "/limited"}, "require_key": True},
    ],
}
ENVOY_OPTIONS = {
    "extra_routes": [
        harness.direct_response("/direct", 201, DIRECT_BODY),
        harness.route("/limited",
                      per_filter=harness.local_ratelimit_route(1, "%ds" % FILL_S)),
    ],
    "post_filters": [harness.local_ratelimit_filter()],
}

BODY = b'{"item":"book","qty":1}'


def _post(envoy, path, key):
    return envoy.post(path, BODY, {"content-type": "application/json", "idempotency-key": key})


def test_direct_response_releases_the_claim(envoy, upstream):
    key = new_key()
    released = envoy.idem("released")
    first = _post(envoy, "/direct/orders", key)
    assert first.status == 201 and first.body == DIRECT_BODY.encode(), first
    assert not first.replayed
    envoy.wait_counter("released", released + 1)
    again = _post(envoy, "/direct/orders", key)
    assert again.status == 201 and again.body == DIRECT_BODY.encode(), again
    assert not again.replayed, again
    envoy.wait_counter("released", released + 2)
    assert upstream.executions(key) == 0


def test_local_rate_limit_after_the_filter_releases_the_claim(envoy, upstream):
    # drain the bucket with other keys until one is refused locally
    released = envoy.idem("released")
    limited_key = None
    since = time.monotonic()
    for _ in range(5):
        k = new_key()
        r = _post(envoy, "/limited", k)
        if r.status == 429:
            limited_key = k
            break
        assert r.status == 201, r
        since = time.monotonic()
    assert limited_key is not None, "the local rate limit never answered 429"
    assert upstream.executions(limited_key) == 0
    envoy.wait_counter("released", released + 1)  # the local 429 released its claim
    # wait for the bucket to refill (one token per FILL_S), then retry the refused request
    remaining = since + FILL_S + 0.3 - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)

    def forwarded():
        r = _post(envoy, "/limited", limited_key)
        assert r.status in (201, 429), r  # 429: the bucket is not refilled yet; never 409
        return r if r.status == 201 else None

    r = harness.wait_until(forwarded, FILL_S + 3, 0.3, "the retry to be forwarded")
    assert not r.replayed, r
    assert upstream.executions(limited_key) == 1
    again = _post(envoy, "/limited", limited_key)  # within the new window, yet a replay
    assert again.replayed and again.header("x-execution") == r.header("x-execution"), again
