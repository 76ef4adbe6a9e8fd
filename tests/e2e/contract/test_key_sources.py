"""C28: where a rule reads its key (`routes[].key`), on a real Envoy.

- `{"json": "/order_id"}`: the business number in the body is the key. The client sends no key
  header; the same order and body replays, another body is 422, no order id is 400, and the
  upstream executes once.
- `{"header": "x-request-id"}`: the rule's own header is the key.
- `{"fingerprint": {"window": "3s"}}`: a legacy client sends no key; the same body within the
  window replays, another body executes, the same body after the window executes again.

On both stores: the key's source is part of the record's scope, which either store keeps.
Each fails on a build before `routes[].key`, which refuses the field (Envoy does not start)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

import harness
from harness import assert_problem, new_key

WINDOW_S = 3


def filter_config(store: dict) -> dict:
    return {"store": store, "routes": ROUTES}


ROUTES = [
    {"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]}, "require_key": True,
     "key": {"json": "/order_id"}},
    {"name": "rid", "match": {"prefix": "/rid", "methods": ["POST"]}, "key": {"header": "x-request-id"}},
    {"name": "legacy", "match": {"prefix": "/legacy", "methods": ["POST"]},
     "key": {"fingerprint": {"window": "%ds" % WINDOW_S}}},
]


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    with harness.envoy_on_store(request.param, "keys", envoy_bin, filter_wasm, upstream, filter_config) as proxy:
        yield proxy


JSON = {"content-type": "application/json"}


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_a_business_number_in_the_body_is_the_key(envoy, upstream):
    order = "ord-" + uuid.uuid4().hex
    before = upstream.total()
    counted = envoy.idem("key_from_json")
    first = envoy.post("/orders", _body(order_id=order, amount=5), JSON)
    assert first.status == 201 and not first.replayed, first
    # The same intent, its members in another order: the first answer, byte for byte.
    again = envoy.post("/orders", b'{"amount":5,"order_id":"%s"}' % order.encode(), JSON)
    assert again.replayed and again.body == first.body, again
    assert again.header("x-execution") == first.header("x-execution"), again
    other = envoy.post("/orders", _body(order_id=order, amount=6), JSON)
    assert_problem(other, 422, "payload-mismatch")
    missing = assert_problem(envoy.post("/orders", _body(amount=5), JSON), 400, "missing-key")
    assert "/order_id" in missing["detail"], missing
    assert upstream.total() == before + 1
    # Counted for each request whose key its body gave.
    envoy.wait_counter("key_from_json", counted + 3)


def test_an_integer_business_number_is_the_same_key_as_its_string(envoy, upstream):
    order = int(time.time() * 1000) % 10**12
    first = envoy.post("/orders", _body(order_id=order, amount=1), JSON)
    assert first.status == 201 and not first.replayed, first
    # "42" and 42 are one intent: another body under it is refused, never a second execution.
    assert_problem(envoy.post("/orders", _body(order_id=str(order), amount=1), JSON), 422, "payload-mismatch")


def test_a_rule_s_own_header_is_its_key(envoy, upstream):
    rid = new_key()
    headers = dict(JSON, **{"x-request-id": rid})
    first = envoy.post("/rid", b'{"a":1}', headers)
    again = envoy.post("/rid", b'{"a":1}', headers)
    assert first.status == 201 and again.replayed and again.body == first.body, (first, again)
    # The same value under key_header is not this rule's key: no key, passed through.
    plain = envoy.post("/rid", b'{"a":1}', dict(JSON, **{"idempotency-key": rid}))
    assert plain.status == 201 and not plain.replayed, plain
    assert upstream.executions(rid) == 1


def test_a_fingerprint_window_replays_a_repeat_and_forgets_it_after(envoy, upstream):
    body = _body(to="bob", amount=5, nonce=uuid.uuid4().hex)
    before = upstream.total()
    first = envoy.post("/legacy", body, JSON)
    assert first.status == 201 and not first.replayed, first
    again = envoy.post("/legacy", body, JSON)
    assert again.replayed and again.body == first.body, again
    other = envoy.post("/legacy", body.replace(b'"amount": 5', b'"amount": 6'), JSON)
    assert other.status == 201 and not other.replayed, other
    assert upstream.total() == before + 2
    # etcd ends a record's lease by its own clock, in whole seconds: a little later.
    time.sleep(WINDOW_S + 2.5)
    later = envoy.post("/legacy", body, JSON)
    assert later.status == 201 and not later.replayed, later
    assert upstream.total() == before + 3
