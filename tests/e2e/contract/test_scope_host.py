"""C8: with `scope_host: "cluster"` a record's host is the upstream cluster Envoy routed the
request to, not the name the caller wrote: in a mesh one service answers to `payments`,
`payments.prod`, `payments.prod.svc.cluster.local`, with or without its port, and a payment
retried under another of its names must not execute twice. Here every host routes to the
cluster `orders` (`domains: ["*"]`): two spellings of the service execute once and replay,
where the default (test_scope.py, `test_different_host_is_a_different_record`) keeps two
records."""

from __future__ import annotations

from harness import new_key

FILTER_CONFIG = {
    "scope_host": "cluster",
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]}}],
}

BODY = b'{"item":"book","qty":1}'


def _post(envoy, key, host):
    headers = [("host", host), ("content-type", "application/json"), ("idempotency-key", key)]
    return envoy.raw("POST", "/orders", headers, BODY)


def test_one_service_under_any_of_its_names_executes_once(envoy, upstream):
    key = new_key()
    first = _post(envoy, key, "payments")
    assert first.status == 201 and not first.replayed, first
    for name in ("payments.prod.svc.cluster.local:8080", "payments.prod", "Payments"):
        again = _post(envoy, key, name)
        assert again.replayed and again.header("x-execution") == first.header("x-execution"), (name, again)
    assert upstream.executions(key) == 1


def test_another_key_on_the_same_service_is_another_record(envoy, upstream):
    a, b = new_key(), new_key()
    ra = _post(envoy, a, "payments")
    rb = _post(envoy, b, "payments.prod")
    assert ra.status == 201 and rb.status == 201 and not ra.replayed and not rb.replayed, (ra, rb)
    assert upstream.executions(a) == 1 and upstream.executions(b) == 1
