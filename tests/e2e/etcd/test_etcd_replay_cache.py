"""C9, C14 with the etcd store's replay cache (`store.replay_cache`), behind one real Envoy and one
real etcd: a hot replay is answered without a callout (the etcd cluster's upstream_rq_total stays
put), another payload under the key is still refused, and a record's expiry ends its replays.

One worker (concurrency 1), so that every request meets the cache its first call filled.
"""

from __future__ import annotations

import time

import pytest

import harness
from harness import assert_problem, key_headers, new_key

BODY = b'{"item":"book","qty":1}'
PREFIX = "/e2e-replay-cache/"
TTL_S = 3
CALLS = "cluster.etcd.upstream_rq_total"


def filter_config(replay_cache: dict | None) -> dict:
    store = harness.etcd_store(prefix=PREFIX)
    if replay_cache is not None:
        store["replay_cache"] = replay_cache
    return {
        "store": store,
        "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                    "ttl": "%ds" % TTL_S, "processing_timeout": "2s"}],
    }



def start_envoy(envoy_bin, filter_wasm, upstream, etcd, replay_cache, name):
    return harness.Envoy(
        envoy_bin, upstream.port, filter_config(replay_cache), wasm_path=filter_wasm, name=name,
        concurrency=1, extra_clusters=[harness.etcd_cluster([etcd.client_port])],
    ).start()


@pytest.fixture(scope="module")
def envoy(envoy_bin, filter_wasm, upstream, etcd):
    proxy = start_envoy(envoy_bin, filter_wasm, upstream, etcd, {"entries": 64, "max_bytes": 1048576},
                        "etcd-replay-cache")
    yield proxy
    proxy.stop()


def test_hot_replays_do_not_touch_etcd(envoy, upstream):
    key = new_key()
    first = envoy.post("/orders", BODY, key_headers(key))
    assert first.status == 201 and not first.replayed
    before = envoy.counter(CALLS)
    assert before >= 4, "the first call claimed and completed in etcd"
    for _ in range(20):
        again = envoy.post("/orders", BODY, key_headers(key))
        assert again.status == 201 and again.replayed
        assert again.body == first.body
    assert envoy.counter(CALLS) == before, "a cached replay makes no callout"
    # Another payload under the key: 422 from the cache, as from etcd.
    assert_problem(envoy.post("/orders", b'{"item":"pen","qty":2}', key_headers(key)), 422,
                   "payload-mismatch")
    assert envoy.counter(CALLS) == before
    assert upstream.executions(key) == 1


def test_a_record_written_by_another_envoy_is_read_once_then_cached(
        envoy, envoy_bin, filter_wasm, upstream, etcd):
    other = start_envoy(envoy_bin, filter_wasm, upstream, etcd, None, "etcd-replay-cache-other")
    try:
        key = new_key()
        first = other.post("/orders", BODY, key_headers(key))
        assert first.status == 201 and not first.replayed
    finally:
        other.stop()
    before = envoy.counter(CALLS)
    assert envoy.post("/orders", BODY, key_headers(key)).replayed
    assert envoy.counter(CALLS) == before + 1, "the first replay here reads etcd"
    for _ in range(5):
        assert envoy.post("/orders", BODY, key_headers(key)).body == first.body
    assert envoy.counter(CALLS) == before + 1
    assert upstream.executions(key) == 1


def test_expiry_ends_cached_replays(envoy, upstream):
    key = new_key()
    assert envoy.post("/orders", BODY, key_headers(key)).status == 201
    assert envoy.post("/orders", BODY, key_headers(key)).replayed
    time.sleep(TTL_S + 0.3)
    before = envoy.counter(CALLS)
    again = envoy.post("/orders", BODY, key_headers(key))
    assert again.status == 201 and not again.replayed, "past its ttl the key executes again"
    assert upstream.executions(key) == 2
    assert envoy.counter(CALLS) > before, "the new claim went to etcd"


def test_without_the_cache_every_replay_reads_etcd(envoy_bin, filter_wasm, upstream, etcd):
    plain = start_envoy(envoy_bin, filter_wasm, upstream, etcd, None, "etcd-replay-cache-off")
    try:
        key = new_key()
        assert plain.post("/orders", BODY, key_headers(key)).status == 201
        before = plain.counter(CALLS)
        for _ in range(3):
            assert plain.post("/orders", BODY, key_headers(key)).replayed
        assert plain.counter(CALLS) == before + 3
    finally:
        plain.stop()
