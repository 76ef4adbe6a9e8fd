"""C8, C19 with a three-member etcd cluster on loopback that loses its leader (SIGKILL) while a
load of unique keys runs through one Envoy: no key executes twice, requests during the election
succeed or get 503 (or 409 for a retry whose claim landed unanswered), and the store works again
without restarting Envoy."""

from __future__ import annotations

import threading
import time

import pytest

import harness
from harness import key_headers, new_key

BODY = b'{"item":"book","qty":1}'

FILTER_CONFIG = {
    "store": harness.etcd_store(prefix="/e2e-cluster/", timeout="250ms"),
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "processing_timeout": "3s"}],
}


@pytest.fixture(scope="module")
def cluster():
    members = harness.EtcdCluster(3, name="etcd-cluster").start()
    yield members
    members.stop()


@pytest.fixture(scope="module")
def envoy(envoy_bin, filter_wasm, upstream, cluster):
    proxy = harness.Envoy(
        envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm, name="etcd-cluster",
        extra_clusters=[harness.etcd_cluster([m.client_port for m in cluster.members])],
    ).start()
    yield proxy
    proxy.stop()


def test_losing_the_leader_under_load_executes_no_key_twice_and_recovers(envoy, upstream, cluster):
    outcomes: dict[str, list[int]] = {}
    refused_at: list[float] = []  # when a 503 came
    lock = threading.Lock()
    stop = threading.Event()

    def client():
        while not stop.is_set():
            key = new_key()
            statuses = []
            # A 503 is retried (as a client would), a few times.
            for _ in range(3):
                resp = envoy.post("/orders", BODY, key_headers(key), timeout=30)
                statuses.append(resp.status)
                if resp.status != 503:
                    break
                with lock:
                    refused_at.append(time.monotonic())
                time.sleep(0.1)
            with lock:
                outcomes[key] = statuses

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    leader = cluster.leader()
    leader.kill()
    killed_at = time.monotonic()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)

    seen = {s for statuses in outcomes.values() for s in statuses}
    assert seen <= {201, 409, 503}, seen
    assert sum(1 for s in outcomes.values() if 201 in s) > 20, "the load ran"
    for key, statuses in outcomes.items():
        executed = upstream.executions(key)
        assert executed <= 1, (key, statuses, executed)
        if statuses[-1] == 201:
            assert executed == 1, (key, statuses)

    # Recovered without restarting Envoy: new keys succeed, and are replayed.
    def works():
        key = new_key()
        first = envoy.post("/orders", BODY, key_headers(key))
        return first.status == 201 and envoy.post("/orders", BODY, key_headers(key)).replayed

    harness.wait_until(works, 15, interval=0.2, what="the store after the election")
    after = [t - killed_at for t in refused_at if t >= killed_at]
    print("leader %s killed: %d keys, statuses %s, %d 503s after the kill, the last %.2f s after it"
          % (leader.name, len(outcomes), sorted(seen), len(after), max(after, default=0.0)))
