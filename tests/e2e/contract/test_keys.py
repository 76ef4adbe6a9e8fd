"""C2, C3, C4: key syntax and missing keys. A missing key passes through on a `require_key: false`
rule (C2) and gets 400 missing-key on a `require_key: true` one (C3); a malformed or repeated key
gets 400 invalid-key (C4), and the quoted and bare forms of a key are one key."""

from __future__ import annotations

import pytest

from harness import assert_problem, new_key

FILTER_CONFIG = {
    # key_header left at its default: idempotency-key
    "store": {"type": "local", "capacity": 1000},
    "routes": [
        {"name": "required", "match": {"prefix": "/orders"}, "require_key": True},
        {"name": "optional", "match": {"prefix": "/optional"}, "require_key": False},
    ],
}

BODY = b'{"item":"book","qty":1}'
JSON = {"content-type": "application/json"}

VISIBLE = "!#$%&'*+-.^_`|~:/@0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _post(envoy, path, key, body=BODY, name="idempotency-key"):
    headers = dict(JSON)
    if key is not None:
        headers[name] = key
    return envoy.post(path, body, headers)


@pytest.mark.parametrize("first_quoted", [False, True])
def test_quoted_and_bare_forms_are_the_same_key(envoy, upstream, first_quoted):
    bare = "abc-" + new_key()
    quoted = '"%s"' % bare
    first = _post(envoy, "/orders", quoted if first_quoted else bare)
    again = _post(envoy, "/orders", bare if first_quoted else quoted)
    assert first.status == 201 and not first.replayed, first
    assert again.status == 201 and again.replayed, again
    assert again.header("x-execution") == first.header("x-execution")
    assert again.body == first.body
    assert upstream.executions(bare) + upstream.executions(quoted) == 1


def test_header_name_is_case_insensitive(envoy, upstream):
    key = new_key()
    first = _post(envoy, "/orders", key, name="Idempotency-Key")
    again = _post(envoy, "/orders", key, name="IDEMPOTENCY-KEY")
    assert first.status == 201 and again.replayed, (first, again)
    assert upstream.executions(key) == 1


@pytest.mark.parametrize("length", [1, 255])
def test_valid_key_lengths(envoy, upstream, length):
    # one Envoy per module: a 1-char key is fresh for this module's store
    key = "Z" if length == 1 else (new_key() + VISIBLE * 4)[:length]
    before = upstream.executions(key)
    first = _post(envoy, "/orders/len%d" % length, key)
    again = _post(envoy, "/orders/len%d" % length, key)
    assert first.status == 201 and not first.replayed, first
    assert again.status == 201 and again.replayed, again
    assert upstream.executions(key) == before + 1


def test_all_visible_ascii_is_allowed(envoy, upstream):
    key = VISIBLE + new_key()
    first = _post(envoy, "/orders", key)
    again = _post(envoy, "/orders", key)
    assert first.status == 201 and again.replayed, (first, again)
    assert upstream.executions(key) == 1


def test_255_char_key_quoted_is_the_same_key(envoy, upstream):
    key = (new_key() + VISIBLE * 4)[:255]
    first = _post(envoy, "/orders", key)
    again = _post(envoy, "/orders", '"%s"' % key)
    assert first.status == 201 and again.status == 201 and again.replayed, (first, again)


INVALID = {
    "empty": "",
    "quoted-empty": '""',
    "256-chars": "k" * 256,
    "space-inside": "abc def",
    "tab-inside": "abc\tdef",
    "unterminated-quote": '"abc-def',
}


@pytest.mark.parametrize("route", ["/orders", "/optional"])
@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_key_is_400(envoy, upstream, route, case):
    path = "%s/%s" % (route, new_key())
    before = envoy.idem("invalid_key")
    r = _post(envoy, path, INVALID[case])
    assert_problem(r, 400, "invalid-key")
    assert upstream.path_executions(path) == 0
    envoy.wait_counter("invalid_key", before + 1)


RAW_INVALID = {
    "non-ascii": b"abc\xc3\xa9def",
    "latin1-byte": b"abc\xe9def",
}


@pytest.mark.parametrize("route", ["/orders", "/optional"])
@pytest.mark.parametrize("case", sorted(RAW_INVALID))
def test_invalid_key_bytes_are_400(envoy, upstream, route, case):
    path = "%s/%s" % (route, new_key())
    r = envoy.raw("POST", path, [("content-type", "application/json"),
                                 (b"idempotency-key", RAW_INVALID[case])], BODY)
    assert_problem(r, 400, "invalid-key")
    assert upstream.path_executions(path) == 0


def test_del_byte_in_key_is_400(envoy, upstream):
    # Envoy's HTTP/1 codec itself refuses a DEL in a header value (plain 400) before any
    # filter runs; either way the request must be refused and never reach the upstream.
    path = "/orders/" + new_key()
    r = envoy.raw("POST", path, [("content-type", "application/json"),
                                 (b"idempotency-key", b"abc\x7fdef")], BODY)
    assert r.status == 400, r
    assert upstream.path_executions(path) == 0


@pytest.mark.parametrize("route", ["/orders", "/optional"])
def test_repeated_key_header_is_400(envoy, upstream, route):
    path = "%s/%s" % (route, new_key())
    key = new_key()
    r = envoy.raw("POST", path, [("content-type", "application/json"),
                                 ("idempotency-key", key), ("idempotency-key", key)], BODY)
    assert_problem(r, 400, "invalid-key")
    assert upstream.path_executions(path) == 0


def test_missing_key_is_400_when_required(envoy, upstream):
    path = "/orders/" + new_key()
    before = envoy.idem("missing_key")
    r = _post(envoy, path, None)
    assert_problem(r, 400, "missing-key")
    assert upstream.path_executions(path) == 0
    envoy.wait_counter("missing_key", before + 1)


def test_missing_key_passes_through_when_optional(envoy, upstream):
    path = "/optional/" + new_key()
    before = envoy.idem("passed_through")
    first = _post(envoy, path, None)
    again = _post(envoy, path, None)
    assert first.status == again.status == 201, (first, again)
    assert not first.replayed and not again.replayed
    assert upstream.path_executions(path) == 2
    envoy.wait_counter("passed_through", before + 2)
