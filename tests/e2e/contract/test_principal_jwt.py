"""C9, C5 with a verified JWT as the caller: a refreshed token is the same caller (its retry
replays), and a token that lacks a configured claim gets 403 principal-incomplete.

A real `envoy.filters.http.jwt_authn` runs before the filter (harness `pre_filters`): one HS256
provider with an inline `oct` JWKS, the token from `authorization: Bearer ...`, the verified
payload in dynamic metadata `jwt_payload`, the Authorization header forwarded, and
`allow_missing` (no token passes, an invalid token gets 401 from jwt_authn).

With `"principal": {"jwt_payload": "jwt_payload", "claims": ["iss", "sub"]}` the record's
principal is the verified (iss, sub), not the Authorization value: a refreshed token (new iat,
exp, jti, so another header value) replays, also while the original is in flight; another sub
is another caller. A request without a verified payload falls back to `principal_headers`
(default `["authorization"]`, here absent: the anonymous principal).
"""

from __future__ import annotations

import threading
import time

import harness
from harness import assert_problem, key_headers, mint_hs256, new_key

ISSUER = "https://issuer.e2e.test"
SECRET = b"e2e-hs256-shared-secret-0123456789abcdef"
OTHER_SECRET = b"not-the-secret-envoy-trusts-0123456789ab"

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "principal": {"jwt_payload": "jwt_payload", "claims": ["iss", "sub"]},
    "quota": {"per_tenant": 1000, "per_principal": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}
ENVOY_OPTIONS = {"pre_filters": [harness.jwt_authn_filter(ISSUER, SECRET, "jwt_payload")]}

BODY = b'{"item":"book","qty":1}'


def token(sub: str, secret: bytes = SECRET, issued_ago: int = 0, issuer: str = ISSUER) -> str:
    """A token for `sub`; every call mints a new jti (and iat/exp move with `issued_ago`), so two
    tokens for one sub are two different Authorization values."""
    now = int(time.time())
    claims = {"iss": issuer, "sub": sub, "iat": now - issued_ago,
              "exp": now - issued_ago + 3600, "jti": new_key()}
    return mint_hs256(secret, claims)


def _post(envoy, key, tok=None, timeout=15.0, **extra):
    if tok is not None:
        extra.setdefault("authorization", "Bearer " + tok)
    headers = key_headers(key, **extra)
    return envoy.post("/orders", BODY, headers, timeout=timeout)


def _fresh(r):
    return r.status == 201 and not r.replayed


def test_refreshed_token_replays(envoy, upstream):
    key = new_key()
    sub = "u1-" + new_key()
    a = token(sub, issued_ago=600)
    a2 = token(sub)
    assert a != a2
    first = _post(envoy, key, a)
    assert _fresh(first), first
    again = _post(envoy, key, a2)
    assert again.status == 201 and again.replayed, again
    assert again.header("x-execution") == first.header("x-execution")
    assert again.body == first.body
    assert upstream.executions(key) == 1


def test_refreshed_token_while_in_flight_gets_409(envoy, upstream):
    key = new_key()
    sub = "u1-" + new_key()
    a = token(sub, issued_ago=600)
    a2 = token(sub)
    results = {}

    def original():
        results["first"] = _post(envoy, key, a, timeout=30, x_delay_ms="1500")

    t = threading.Thread(target=original, daemon=True)
    t.start()
    try:
        harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the original")
        dup = _post(envoy, key, a2)
        assert_problem(dup, 409, "request-in-flight")
    finally:
        t.join(30)
    assert _fresh(results["first"]), results["first"]
    again = _post(envoy, key, a2)
    assert again.replayed and again.header("x-execution") == results["first"].header("x-execution")
    assert upstream.executions(key) == 1


def test_other_subject_is_another_caller(envoy, upstream):
    key = new_key()
    u1 = _post(envoy, key, token("u1-" + new_key()))
    u2 = _post(envoy, key, token("u2-" + new_key()))
    assert _fresh(u1) and _fresh(u2), (u1, u2)
    assert upstream.executions(key) == 2


def test_verified_caller_and_anonymous_do_not_share(envoy, upstream):
    # no token: no verified payload, so the principal comes from principal_headers (default
    # authorization, absent here): the anonymous principal, not the token's subject
    key = new_key()
    verified = _post(envoy, key, token("u1-" + new_key()))
    anon = _post(envoy, key)
    assert _fresh(verified) and _fresh(anon), (verified, anon)
    anon2 = _post(envoy, key)
    assert anon2.replayed and anon2.header("x-execution") == anon.header("x-execution")
    assert upstream.executions(key) == 2


def test_forged_token_is_refused_before_the_filter(envoy, upstream):
    key = new_key()
    sub = "u1-" + new_key()
    forged = _post(envoy, key, token(sub, secret=OTHER_SECRET))
    assert forged.status == 401, forged
    assert not forged.replayed
    assert upstream.executions(key) == 0
    # and it did not leave a claim behind: the real caller executes normally
    real = _post(envoy, key, token(sub))
    assert _fresh(real), real
    assert upstream.executions(key) == 1


# C5: a verified payload that lacks a configured claim is no identity. Before, a
# token with `iss` but no `sub` was accepted as the caller (iss, <absent>), so every such caller
# was one principal and replayed the others' answers; it is now refused with 403
# `principal-incomplete` (counter `principal_incomplete`), never executed. A request without any
# verified payload still falls back to principal_headers (test above).


def _token_without(*missing: str, **extra: str) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "sub": "u-" + new_key(), "iat": now, "exp": now + 3600,
              "jti": new_key()}
    for name in missing:
        del claims[name]
    claims.update(extra)
    return mint_hs256(SECRET, claims)


def test_tokens_lacking_a_configured_claim_are_not_one_caller(envoy, upstream):
    key = new_key()
    before = envoy.idem("principal_incomplete")
    alice = _post(envoy, key, _token_without("sub", name="alice"))
    bob = _post(envoy, key, _token_without("sub", name="bob"))
    assert not bob.replayed, "bob got alice's stored answer: %r" % (bob,)
    assert_problem(alice, 403, "principal-incomplete")
    assert_problem(bob, 403, "principal-incomplete")
    assert upstream.executions(key) == 0
    envoy.wait_counter("principal_incomplete", before + 2)


def test_a_payload_without_any_configured_claim_is_refused(envoy_bin, filter_wasm, upstream):
    # claims (sub, org) and a verified token carrying neither (jwt_authn needs its iss): there
    # is a verified payload, so the caller is not taken from the raw authorization header,
    # which the operator chose not to trust. A request without a token still falls back.
    cfg = dict(FILTER_CONFIG, principal={"jwt_payload": "jwt_payload", "claims": ["sub", "org"]})
    with harness.Envoy(envoy_bin, upstream.port, cfg, wasm_path=filter_wasm, name="jwt-no-claims",
                       concurrency=1, **ENVOY_OPTIONS) as proxy:
        key = new_key()
        r = _post(proxy, key, _token_without("sub", name="carol"))
        assert_problem(r, 403, "principal-incomplete")
        assert upstream.executions(key) == 0
        anon = _post(proxy, key)
        assert _fresh(anon), anon
        assert _post(proxy, key).replayed
        assert upstream.executions(key) == 1
