"""C17: quota. One principal (here: one `authorization` value) or one tenant
(`tenant_header: x-tenant-id`) may hold at most `quota.per_principal` / `quota.per_tenant` live
records. A new key past the bound gets 429 problem `quota-exceeded` with `retry-after` (counter
`quota_exceeded`) and is not executed; everyone else keeps working, and the full principal's or
tenant's existing keys still replay (or get 409 while in flight).

Every test uses its own tenant and principals (records live for the default ttl of 24h). The
tenant bound applies only with a `tenant_header`. Without `quota` no bound applies at all
(tests/e2e/contract/test_quota_defaults.py).
"""

from __future__ import annotations

import threading

import harness
from harness import assert_problem, key_headers, new_key, retry_after_seconds

PER_PRINCIPAL = 3
PER_TENANT = 5

FILTER_CONFIG = {
    "tenant_header": "x-tenant-id",
    "principal_headers": ["authorization"],
    "store": {"type": "local", "capacity": 1000},
    "quota": {"per_tenant": PER_TENANT, "per_principal": PER_PRINCIPAL},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}

BODY = b'{"item":"book","qty":1}'


def _post(envoy, key, tenant, principal, timeout=15.0, **extra):
    extra.setdefault("authorization", "Bearer " + principal)
    if tenant is not None:
        extra.setdefault("x_tenant_id", tenant)
    headers = key_headers(key, **extra)
    return envoy.post("/orders", BODY, headers, timeout=timeout)


def _fresh(r):
    return r.status == 201 and not r.replayed


def _exceeded(envoy, upstream, r, key, before):
    assert_problem(r, 429, "quota-exceeded")
    retry_after_seconds(r)
    assert upstream.executions(key) == 0
    envoy.wait_counter("quota_exceeded", before + 1)


def test_principal_quota(envoy, upstream):
    tenant, p, q = "t-" + new_key(), "p-" + new_key(), "q-" + new_key()
    keys = [new_key() for _ in range(PER_PRINCIPAL)]
    firsts = {}
    for k in keys[:-1]:
        firsts[k] = _post(envoy, k, tenant, p)
        assert _fresh(firsts[k]), firsts[k]

    # the last of p's records is still in flight while p is at its bound
    def slow():
        firsts[keys[-1]] = _post(envoy, keys[-1], tenant, p, timeout=30, x_delay_ms="1500")

    t = threading.Thread(target=slow, daemon=True)
    t.start()
    try:
        harness.wait_until(lambda: upstream.executions(keys[-1]) == 1, 10, what="p's last key")
        over = new_key()
        before = envoy.idem("quota_exceeded")
        _exceeded(envoy, upstream, _post(envoy, over, tenant, p), over, before)
        # its in-flight key is still a duplicate (409), not a quota refusal
        assert_problem(_post(envoy, keys[-1], tenant, p), 409, "request-in-flight")
        # its completed keys still replay
        again = _post(envoy, keys[0], tenant, p)
        assert again.replayed and again.header("x-execution") == firsts[keys[0]].header("x-execution")
        # another principal of the same tenant (below the tenant bound) keeps working
        other = new_key()
        assert _fresh(_post(envoy, other, tenant, q))
    finally:
        t.join(30)
    assert _fresh(firsts[keys[-1]]), firsts[keys[-1]]
    assert _post(envoy, keys[-1], tenant, p).replayed
    # still at its bound: a new key is still refused
    before = envoy.idem("quota_exceeded")
    _exceeded(envoy, upstream, _post(envoy, over, tenant, p), over, before)
    assert all(upstream.executions(k) == 1 for k in keys)


def test_tenant_quota_across_principals(envoy, upstream):
    tenant, other_tenant = "t-" + new_key(), "t-" + new_key()
    p1, p2, p3, p4 = ("p-" + new_key() for _ in range(4))
    created = []
    for principal, n in ((p1, PER_PRINCIPAL), (p2, PER_TENANT - PER_PRINCIPAL)):
        for _ in range(n):
            k = new_key()
            r = _post(envoy, k, tenant, principal)
            assert _fresh(r), r
            created.append((k, principal, r))
    assert len(created) == PER_TENANT
    # the tenant is full: p2 (below its own bound) and a new p3 are refused
    for principal in (p2, p3):
        k = new_key()
        before = envoy.idem("quota_exceeded")
        _exceeded(envoy, upstream, _post(envoy, k, tenant, principal), k, before)
    # another tenant keeps working
    k = new_key()
    assert _fresh(_post(envoy, k, other_tenant, p4))
    # the full tenant's records still replay
    for k, principal, first in created:
        again = _post(envoy, k, tenant, principal)
        assert again.replayed and again.header("x-execution") == first.header("x-execution"), again
