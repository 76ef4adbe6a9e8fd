"""A rolling change of `store.shards` from two etcd clusters to three, under load
(`store.previous_shards`, docs/ETCD.md "Shards"). Three Envoys stand for the three kinds a
rolling update runs side by side: one on the old list, one on the new list with the old one as
`previous_shards`, and one on the new list alone (which the procedure starts only once the old
list is gone). 100 keys in flight, each sent to two of them at once: none executes twice; every
record stored before the change replays after it; a record stored during the change replays on
the new list alone."""

from __future__ import annotations

import threading

import pytest

import harness
from harness import key_headers, new_key

BODY = b'{"item":"book","qty":1}'
PREFIX = "/e2e-shard-change/"
OLD = ["etcd-a", "etcd-b"]
NEW = ["etcd-a", "etcd-b", "etcd-c"]


def filter_config(shards: list[str], previous: list[str] | None = None) -> dict:
    # A loaded two-core machine answers 200 requests at once slower than the default 250 ms.
    store = {"type": "etcd", "prefix": PREFIX, "timeout": "3s", "shards": [{"cluster": c} for c in shards]}
    if previous:
        store["previous_shards"] = [{"cluster": c} for c in previous]
    return {"store": store,
            "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                        "processing_timeout": "30s"}]}


@pytest.fixture(scope="module")
def members():
    started = {c: harness.Etcd("change-" + c).start() for c in NEW}
    yield started
    for m in started.values():
        m.stop()


@pytest.fixture(scope="module")
def envoys(envoy_bin, filter_wasm, upstream, members):
    clusters = [harness.etcd_cluster([m.client_port], name=c) for c, m in members.items()]
    started = {
        name: harness.Envoy(envoy_bin, upstream.port, config, wasm_path=filter_wasm, name="change-" + name,
                            extra_clusters=clusters).start()
        for name, config in (("old", filter_config(OLD)), ("moving", filter_config(NEW, OLD)),
                             ("new", filter_config(NEW)))
    }
    yield started
    for proxy in started.values():
        proxy.stop()


def records(member) -> int:
    return len(member.keys(PREFIX + "r/"))


def both_at_once(first, second, keys: list[str]) -> dict[str, list[int]]:
    """Each key sent to both Envoys at the same moment (the upstream slow enough that the two
    overlap), 100 keys in flight: the statuses each key got."""
    statuses: dict[str, list[int]] = {k: [] for k in keys}
    lock = threading.Lock()
    start = threading.Barrier(len(keys) * 2)

    def send(proxy, key):
        try:
            start.wait(30)
            resp = proxy.post("/orders", BODY, key_headers(key, x_delay_ms="400"), timeout=60)
            status = resp.status
        except Exception as exc:  # noqa: BLE001 - asserted below
            status = repr(exc)
        with lock:
            statuses[key].append(status)

    threads = [threading.Thread(target=send, args=(proxy, key)) for key in keys for proxy in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return statuses


def test_a_rolling_change_from_two_shards_to_three_executes_no_key_twice(envoys, members, upstream):
    old, moving, new = envoys["old"], envoys["moving"], envoys["new"]
    # Before the change: records on the two old shards only.
    before = [new_key() for _ in range(40)]
    for key in before:
        assert old.post("/orders", BODY, key_headers(key)).status == 201
    assert records(members["etcd-c"]) == 0
    assert records(members["etcd-a"]) > 5 and records(members["etcd-b"]) > 5

    # During the change: each key sent to an old-list Envoy and a moving one at once.
    during = [new_key() for _ in range(100)]
    statuses = both_at_once(old, moving, during)
    for key, got in statuses.items():
        assert upstream.executions(key) == 1, (key, got)
        assert sorted(got) in ([201, 201], [201, 409]), (key, got)
    # What the moving Envoy stores goes to its new home too (the third shard for a third of the
    # keys), and the new list alone replays it.
    for key in (new_key() for _ in range(30)):
        assert moving.post("/orders", BODY, key_headers(key)).status == 201
        again = new.post("/orders", BODY, key_headers(key))
        assert again.status == 201 and again.replayed, (key, again)
    assert records(members["etcd-c"]) > 0

    # Every record stored before the change replays on the moving Envoy, and still on the old.
    for key in before:
        for proxy in (moving, old):
            again = proxy.post("/orders", BODY, key_headers(key))
            assert again.status == 201 and again.replayed, (key, again)
        assert upstream.executions(key) == 1

    # The change's second half: the moving Envoy beside one on the new list alone.
    after = [new_key() for _ in range(100)]
    statuses = both_at_once(moving, new, after)
    for key, got in statuses.items():
        assert upstream.executions(key) == 1, (key, got)
        assert sorted(got) in ([201, 201], [201, 409]), (key, got)
    # What the moving Envoy stored is on the new homes: the new list alone replays it.
    for key in after:
        again = new.post("/orders", BODY, key_headers(key))
        assert again.status == 201 and again.replayed, (key, again)
        assert upstream.executions(key) == 1
