"""Turning the filter off on one route without a new module (issue 47; OPERATIONS.md, "Turning
the filter off in an emergency"): Envoy's route-level `FilterConfig{disabled: true}` in the
route's `typed_per_filter_config` takes the filter out of that route's chain, so a duplicate
there executes again, while the other routes keep their records and replays."""

from __future__ import annotations

from harness import key_headers, new_key, route

OFF = {"idempotency": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}}
FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/", "methods": ["POST"]}, "require_key": True}],
}
ENVOY_OPTIONS = {"extra_routes": [route("/off", per_filter=OFF)]}
BODY = b'{"item":"book","qty":1}'


def test_a_disabled_route_passes_untouched_and_the_others_stay_protected(envoy, upstream):
    off, on = new_key(), new_key()
    for _ in range(2):
        assert envoy.post("/off/orders", BODY, key_headers(off)).status == 201
    assert upstream.executions(off) == 2
    # No key at all on the disabled route: no 400 either.
    assert envoy.post("/off/orders", BODY, {"content-type": "application/json"}).status == 201
    first = envoy.post("/orders", BODY, key_headers(on))
    again = envoy.post("/orders", BODY, key_headers(on))
    assert first.status == 201 and again.replayed, (first, again)
    assert upstream.executions(on) == 1
