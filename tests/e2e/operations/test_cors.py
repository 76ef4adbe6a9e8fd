"""C9 for browser callers (CORS): a replay carries the CORS headers a browser needs. Envoy's CORS
filter runs before the idempotency filter, with a CorsPolicy on the virtual host, as
envoy/envoy.yaml ships it.

- A preflight (`OPTIONS /orders` from an allowed origin, asking for POST with `idempotency-key,
  content-type`) is answered by the CORS filter: 200, the key header allowed, the origin echoed.
  It never reaches the idempotency filter or the upstream: nothing claimed, nothing refused for
  a missing key, nothing executed.
- A cross-origin POST with a key and its retry: both answers carry the CORS headers a browser
  needs to hand them to JavaScript (`access-control-allow-origin`, and
  `access-control-expose-headers` naming `idempotent-replayed`), the replay (a local reply of the
  filter) included. The retry is a replay with the first body; the upstream executed once.
- A preflight from an origin the policy does not name gets no `access-control-allow-origin`
  (the browser then refuses to send the POST), and with `forward_not_matching_preflights: false`
  (as envoy/envoy.yaml ships it) Envoy answers it itself: nothing reaches the upstream.
"""

from __future__ import annotations

import harness
from harness import key_headers, new_key

ORIGIN = "http://localhost:3000"
OTHER_ORIGIN = "http://evil.example"

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}
ENVOY_OPTIONS = {
    "pre_filters": [harness.cors_filter()],
    "virtual_host_per_filter": harness.cors_policy([ORIGIN]),
}

BODY = b'{"item":"book","qty":1}'


def _tokens(value: str | None) -> set[str]:
    """A comma-separated header value as a set of lower-case tokens."""
    return {t.strip().lower() for t in (value or "").split(",") if t.strip()}


def _preflight(envoy, origin: str):
    return envoy.request("OPTIONS", "/orders", headers={
        "origin": origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "idempotency-key, content-type",
    })


def test_preflight_is_answered_by_cors_and_claims_nothing(envoy, upstream):
    before = {o: envoy.idem(o) for o in ("claimed", "missing_key", "passed_through")}
    executed = upstream.total()
    resp = _preflight(envoy, ORIGIN)
    assert resp.status == 200, resp
    assert resp.header("access-control-allow-origin") == ORIGIN, resp
    assert {"idempotency-key", "content-type"} <= _tokens(resp.header("access-control-allow-headers")), resp
    assert "post" in _tokens(resp.header("access-control-allow-methods")), resp
    assert resp.header("access-control-max-age"), resp
    assert not resp.replayed, resp
    # Neither the filter (which counts every request it sees, passed_through for one no rule
    # protects) nor the upstream saw it.
    after = {o: envoy.idem(o) for o in before}
    assert after == before, (before, after)
    assert upstream.total() == executed
    # Control: the same OPTIONS without Origin is no preflight. Envoy forwards it; the filter
    # passes it through (its rule protects POST and PATCH, the default `methods`) and counts it.
    plain = envoy.request("OPTIONS", "/orders")
    assert plain.status == 201 and not plain.replayed, plain
    assert plain.header("access-control-allow-origin") is None, plain
    envoy.wait_counter("passed_through", before["passed_through"] + 1)
    assert envoy.idem("claimed") == before["claimed"]
    assert upstream.total() == executed + 1


def test_post_and_its_replay_carry_the_cors_headers(envoy, upstream):
    key = new_key()
    headers = dict(key_headers(key), origin=ORIGIN)
    stored = envoy.idem("stored")
    first = envoy.post("/orders", BODY, headers)
    assert first.status == 201 and not first.replayed, first
    envoy.wait_counter("stored", stored + 1)
    retry = envoy.post("/orders", BODY, headers)
    assert retry.status == 201 and retry.replayed, retry
    assert retry.body == first.body, (first, retry)
    assert upstream.executions(key) == 1
    for resp in (first, retry):
        # Without these a browser hides the answer from JavaScript, or at least hides the
        # replay marker: a replay must be as readable as the original.
        assert resp.header("access-control-allow-origin") == ORIGIN, resp
        exposed = _tokens(resp.header("access-control-expose-headers"))
        assert {"idempotent-replayed", "retry-after"} <= exposed, resp


def test_preflight_from_an_origin_not_allowed_gets_no_allow_origin(envoy, upstream):
    executed = upstream.total()
    claimed = envoy.idem("claimed")
    passed = envoy.idem("passed_through")
    resp = _preflight(envoy, OTHER_ORIGIN)
    assert resp.header("access-control-allow-origin") is None, resp
    # Answered by the CORS filter (forward_not_matching_preflights: false): Envoy's default
    # would forward it upstream as a plain OPTIONS request (measured: the demo upstream executed
    # it and answered 201).
    assert resp.status == 200, resp
    assert upstream.total() == executed, resp
    assert envoy.idem("claimed") == claimed
    assert envoy.idem("passed_through") == passed


def test_a_problem_answer_carries_the_cors_headers(envoy, upstream):
    # The filter's own refusals are local replies too: a browser reads them only with
    # access-control-allow-origin.
    resp = envoy.post("/orders", BODY, {"content-type": "application/json", "origin": ORIGIN})
    harness.assert_problem(resp, 400, "missing-key")
    assert resp.header("access-control-allow-origin") == ORIGIN, resp
    assert "idempotent-replayed" in _tokens(resp.header("access-control-expose-headers")), resp
