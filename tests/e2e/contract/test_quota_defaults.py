"""C17, C8: the default configuration never refuses honest traffic for quota.

Quotas are opt-in: without a `quota` key no tenant or caller bound applies, so the filter never
answers 429 `quota-exceeded`, however few callers it can tell apart. Before, the defaults were
capacity/10 live records per caller and capacity/4 per tenant: a deployment without identity
(every anonymous request is one principal), or one reached through a single service token, got
429 once a tenth of the store was live.

One Envoy, capacity 200, a `tenant_header` and no `quota`: one anonymous caller without a
tenant, then one service token of one tenant, each with 90 new keys, fill the store to 90%
(where the store itself refuses nothing yet, tests/e2e/local/test_store_capacity.py). Every new key
executes once; nothing is refused.
"""

from __future__ import annotations

from harness import key_headers, new_key

CAPACITY = 200

FILTER_CONFIG = {
    "tenant_header": "x-tenant-id",
    "store": {"type": "local", "capacity": CAPACITY},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "ttl": "1h"}],
}

BODY = b'{"qty":1}'


def _fill(envoy, upstream, count, **extra):
    for i in range(count):
        key = new_key()
        r = envoy.post("/orders", BODY, key_headers(key, **extra), timeout=30)
        assert r.status == 201 and not r.replayed, (i, r)
        assert upstream.executions(key) == 1


def test_one_anonymous_caller_and_one_service_token_fill_the_store_unrefused(envoy, upstream):
    refused = envoy.idem("quota_exceeded")
    full = envoy.idem("store_full")
    # no authorization, no tenant: the anonymous principal, the empty tenant
    _fill(envoy, upstream, CAPACITY * 9 // 20)
    # every request through one service token, for one tenant
    _fill(envoy, upstream, CAPACITY * 9 // 20,
          authorization="Bearer service-" + new_key(), x_tenant_id="t-" + new_key())
    assert envoy.idem("quota_exceeded") == refused
    assert envoy.idem("store_full") == full
