"""C8, C9: an upstream answer is known without a host call, and still known without the hint.

The filter takes `x-envoy-upstream-service-time` (the router's header on every upstream answer)
as proof that a response came from the upstream, and reads `response.code_details` only when the
header is absent. Some operators set the router's `suppress_envoy_headers: true`; there every
answer lacks the header, and Envoy's own word must decide:
- an upstream answer is stored and replayed (it executed once);
- a `direct_response` route still releases the claim (it never executed).
"""

from __future__ import annotations

import harness
from harness import key_headers, new_key

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True},
        {"name": "direct", "match": {"prefix": "/direct"}, "require_key": True},
    ],
}
ENVOY_OPTIONS = {
    "suppress_envoy_headers": True,
    "extra_routes": [harness.direct_response("/direct", 201, '{"direct":true}')],
}

BODY = b'{"item":"book","qty":1}'


def test_an_upstream_answer_without_the_routers_header_is_stored_and_replayed(envoy, upstream):
    key = new_key()
    stored = envoy.idem("stored")
    first = envoy.post("/orders", BODY, key_headers(key))
    assert first.status == 201 and not first.replayed, first
    assert first.header("x-envoy-upstream-service-time") is None  # the hint really is gone
    envoy.wait_counter("stored", stored + 1)
    again = envoy.post("/orders", BODY, key_headers(key))
    assert again.status == 201 and again.replayed, again
    assert again.body == first.body
    assert upstream.executions(key) == 1


def test_a_direct_response_without_the_routers_header_still_releases(envoy, upstream):
    key = new_key()
    released = envoy.idem("released")
    first = envoy.post("/direct", BODY, key_headers(key))
    assert first.status == 201 and not first.replayed, first
    envoy.wait_counter("released", released + 1)
    again = envoy.post("/direct", BODY, key_headers(key))
    assert again.status == 201 and not again.replayed, again
