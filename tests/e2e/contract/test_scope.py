"""C8, C9: a record belongs to (tenant, principal, host, method, path, key). The same scope
replays (C9); the same key in another scope is another record, forwarded as a first request (C8).

The host: `Host: a.example` and `Host: b.example` are two records; the host is compared
lower-cased and without the scheme's default port (`A.Example:80` is `a.example` on plain HTTP),
without the trailing dot of an absolute name (`a.example.`) and with its port's digits read as
a number (`a.example:0080` is `a.example` on plain HTTP, `:010000` is `:10000`).
One `x-tenant-id: a,b` header and two headers `a` + `b` are two different tenants. (Envoy's
virtual host here has `domains: ["*"]`, so any host routes.)"""

from __future__ import annotations

from harness import key_headers, new_key

FILTER_CONFIG = {
    "key_header": "idempotency-key",
    "tenant_header": "x-tenant-id",
    "principal_headers": ["authorization"],
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders", "methods": ["POST", "PATCH"]}}],
}

BODY = b'{"item":"book","qty":1}'


def _call(envoy, key, method="POST", path="/orders", **extra):
    headers = key_headers(key, **extra)
    return envoy.request(method, path, BODY, headers)


def _fresh(r):
    return r.status == 201 and not r.replayed


def _two_records(envoy, upstream, key, one: dict, other: dict):
    """The same key with `one` and with `other` (keyword arguments of _call) executes twice:
    two records. Returns both responses."""
    a = _call(envoy, key, **one)
    b = _call(envoy, key, **other)
    assert _fresh(a) and _fresh(b), (a, b)
    assert upstream.executions(key) == 2
    return a, b


def _replays(envoy, key, first, **extra):
    """The call `extra` again replays `first`."""
    again = _call(envoy, key, **extra)
    assert again.replayed and again.header("x-execution") == first.header("x-execution"), again


def test_same_principal_replays(envoy, upstream):
    key = new_key()
    a = _call(envoy, key, authorization="Bearer alice", x_tenant_id="t1")
    b = _call(envoy, key, authorization="Bearer alice", x_tenant_id="t1")
    assert _fresh(a) and b.replayed, (a, b)
    assert upstream.executions(key) == 1


def test_different_principal_is_a_different_record(envoy, upstream):
    key = new_key()
    alice = _call(envoy, key, authorization="Bearer alice")
    bob = _call(envoy, key, authorization="Bearer bob")
    assert _fresh(alice) and _fresh(bob), (alice, bob)
    assert upstream.executions(key) == 2
    # each caller gets its own response back
    alice2 = _call(envoy, key, authorization="Bearer alice")
    bob2 = _call(envoy, key, authorization="Bearer bob")
    assert alice2.replayed and alice2.header("x-execution") == alice.header("x-execution")
    assert bob2.replayed and bob2.header("x-execution") == bob.header("x-execution")
    assert upstream.executions(key) == 2


def test_different_tenant_is_a_different_record(envoy, upstream):
    key = new_key()
    t1, t2 = _two_records(envoy, upstream, key, {"authorization": "Bearer alice", "x_tenant_id": "t1"},
                          {"authorization": "Bearer alice", "x_tenant_id": "t2"})
    _replays(envoy, key, t2, authorization="Bearer alice", x_tenant_id="t2")


def test_anonymous_callers_share_records(envoy, upstream):
    key = new_key()
    first = _call(envoy, key)
    again = _call(envoy, key)
    assert _fresh(first) and again.replayed, (first, again)
    assert upstream.executions(key) == 1


def test_anonymous_and_authenticated_do_not_share(envoy, upstream):
    key = new_key()
    anon = _call(envoy, key)
    auth = _call(envoy, key, authorization="Bearer alice")
    assert _fresh(anon) and _fresh(auth), (anon, auth)
    assert upstream.executions(key) == 2
    anon2 = _call(envoy, key)
    auth2 = _call(envoy, key, authorization="Bearer alice")
    assert anon2.replayed and anon2.header("x-execution") == anon.header("x-execution")
    assert auth2.replayed and auth2.header("x-execution") == auth.header("x-execution")


def test_same_key_on_another_path_is_independent(envoy, upstream):
    key = new_key()
    a = _call(envoy, key, path="/orders/a")
    b = _call(envoy, key, path="/orders/b")
    assert _fresh(a) and _fresh(b), (a, b)  # not a replay, not a 422
    assert upstream.executions(key) == 2
    assert _call(envoy, key, path="/orders/a").header("x-execution") == a.header("x-execution")


def test_same_key_with_another_method_is_independent(envoy, upstream):
    key = new_key()
    _, patch = _two_records(envoy, upstream, key, {"method": "POST", "path": "/orders/1"},
                            {"method": "PATCH", "path": "/orders/1"})
    _replays(envoy, key, patch, method="PATCH", path="/orders/1")


def _raw(envoy, key, host, extra=()):
    headers = [("host", host), ("content-type", "application/json"),
               ("idempotency-key", key)] + list(extra)
    return envoy.raw("POST", "/orders", headers, BODY)


def test_different_host_is_a_different_record(envoy, upstream):
    key = new_key()
    a = _raw(envoy, key, "a.example")
    b = _raw(envoy, key, "b.example")
    assert _fresh(a) and _fresh(b), (a, b)
    assert upstream.executions(key) == 2
    a2 = _raw(envoy, key, "a.example")
    b2 = _raw(envoy, key, "b.example")
    assert a2.replayed and a2.header("x-execution") == a.header("x-execution"), a2
    assert b2.replayed and b2.header("x-execution") == b.header("x-execution"), b2
    assert upstream.executions(key) == 2


def test_host_is_lower_cased_and_the_default_port_dropped(envoy, upstream):
    key = new_key()
    a = _raw(envoy, key, "a.example")
    assert _fresh(a), a
    same = _raw(envoy, key, "A.Example:80")
    assert same.replayed and same.header("x-execution") == a.header("x-execution"), same
    # the normalized host is still compared, not ignored
    other = _raw(envoy, key, "B.Example:80")
    assert _fresh(other), other
    assert upstream.executions(key) == 2


def test_the_absolute_name_and_a_port_with_leading_zeros_are_the_same_host(envoy, upstream):
    key = new_key()
    a = _raw(envoy, key, "a.example")
    assert _fresh(a), a
    # Envoy serves plain HTTP here: port 80, spelled any way, is the scheme's default port.
    for spelled in ("a.example.", "A.Example.", "a.example:0080", "a.example.:080", "a.example:"):
        again = _raw(envoy, key, spelled)
        assert again.replayed and again.header("x-execution") == a.header("x-execution"), (spelled, again)
    # The listener's own port is no default: it stays part of the host, however it is spelled.
    port = _raw(envoy, key, "a.example:%d" % envoy.port)
    assert _fresh(port), port
    for spelled in ("a.example:0%d" % envoy.port, "a.example.:%d" % envoy.port):
        again = _raw(envoy, key, spelled)
        assert again.replayed and again.header("x-execution") == port.header("x-execution"), (spelled, again)
    # Still compared: another name, or another port, is another record.
    assert _fresh(_raw(envoy, key, "a.example.com."))
    assert _fresh(_raw(envoy, key, "a.example:8080"))
    assert upstream.executions(key) == 4


def test_one_tenant_header_with_a_comma_is_not_two_headers(envoy, upstream):
    key = new_key()
    t = new_key()
    joined = _raw(envoy, key, "a.example", [("x-tenant-id", "a%s,b%s" % (t, t))])
    split = _raw(envoy, key, "a.example", [("x-tenant-id", "a" + t), ("x-tenant-id", "b" + t)])
    assert _fresh(joined) and _fresh(split), (joined, split)
    assert upstream.executions(key) == 2
    again = _raw(envoy, key, "a.example", [("x-tenant-id", "a%s,b%s" % (t, t))])
    assert again.replayed and again.header("x-execution") == joined.header("x-execution"), again
