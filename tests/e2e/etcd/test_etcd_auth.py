"""The etcd store with etcd authentication, through a real Envoy and a real etcd (JWT tokens,
which carry the auth revision they were issued at): a user added by an operator does not stop
the store (the refused token is fetched again), and a burst of new keys on fresh workers costs
etcd one authenticate per worker, not one per request (counted by etcd's own gRPC metrics).
Each with both store protocols: the JSON gateway (token in `authorization`) and gRPC (token in
the call's `token` metadata)."""

from __future__ import annotations

import base64
import threading
import time

import pytest

import harness
from harness import key_headers, new_key

BODY = b'{"item":"book","qty":1}'
PREFIX = "/e2e-auth/"
USER, PASSWORD = "idem", "idem-pw"
BURST = 32


def filter_config(protocol: str = "json") -> dict:
    return {
        "store": harness.etcd_store(prefix=PREFIX, auth={"username": USER, "password": PASSWORD},
                                    protocol=protocol),
        "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                    "processing_timeout": "30s"}],
    }


FILTER_CONFIG = filter_config()


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    key = tmp_path_factory.mktemp("etcd-jwt") / "hs256.key"
    key.write_bytes(b"an-e2e-only-hmac-secret-of-32-bytes")
    member = harness.Etcd("etcd-auth", extra_args=[
        "--auth-token", "jwt,priv-key=%s,sign-method=HS256,ttl=10m" % key]).start()
    for path, doc in [
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": USER}),
        ("/v3/auth/role/grant", {"name": USER, "perm": {
            "permType": "READWRITE", "key": b64(PREFIX), "range_end": b64(PREFIX[:-1] + "0")}}),
        ("/v3/auth/user/add", {"name": USER, "password": PASSWORD}),
        ("/v3/auth/user/grant", {"user": USER, "role": USER}),
        ("/v3/auth/enable", {}),
    ]:
        member.post(path, doc)
    yield member
    member.stop()


def root_token(etcd) -> str:
    return etcd.post("/v3/auth/authenticate", {"name": "root", "password": "rootpw"})["token"]


def authenticates(etcd) -> int:
    """Authenticate calls etcd has handled (the gateway forwards each as a gRPC call)."""
    return int(etcd.metric("grpc_server_handled_total", grpc_method="Authenticate"))


def settled_authenticates(etcd) -> int:
    """`authenticates` once it has not moved for a second: a call the filter gave up on (its
    callout timed out) is still handled by etcd, and counted, later."""
    last, still = authenticates(etcd), 0
    for _ in range(60):
        time.sleep(0.25)
        now = authenticates(etcd)
        still = still + 1 if now == last else 0
        if still >= 4:
            break
        last = now
    return last


@pytest.fixture(params=["json", "grpc"])
def protocol(request) -> str:
    return request.param


def proxy(envoy_bin, filter_wasm, upstream, etcd, name, protocol):
    return harness.Envoy(
        envoy_bin, upstream.port, filter_config(protocol), wasm_path=filter_wasm,
        name=f"{name}-{protocol}",
        extra_clusters=[harness.etcd_cluster([etcd.client_port], grpc=protocol == "grpc")],
    ).start()


def test_a_user_added_elsewhere_does_not_stop_the_store(envoy_bin, filter_wasm, upstream, etcd, protocol):
    envoy = proxy(envoy_bin, filter_wasm, upstream, etcd, "etcd-auth-change", protocol)
    try:
        # Every worker gets a token (two workers: enough requests to reach both).
        for _ in range(6):
            assert envoy.post("/orders", BODY, key_headers(new_key())).status == 201
        errors = envoy.idem("store_error")
        # An operator adds a user: every token issued before is refused from now on.
        etcd.post("/v3/auth/user/add", {"name": "other-%s" % new_key()[:8], "password": "pw"},
                  token=root_token(etcd))
        for _ in range(6):
            key = new_key()
            first = envoy.post("/orders", BODY, key_headers(key))
            assert first.status == 201, first
            again = envoy.post("/orders", BODY, key_headers(key))
            assert again.status == 201 and again.replayed
        assert envoy.idem("store_error") == errors
    finally:
        envoy.stop()


def test_a_burst_on_fresh_workers_authenticates_once_per_worker(envoy_bin, filter_wasm, upstream,
                                                                 etcd, protocol):
    envoy = proxy(envoy_bin, filter_wasm, upstream, etcd, "etcd-auth-burst", protocol)
    try:
        before = settled_authenticates(etcd)
        statuses: list[int] = []
        lock = threading.Lock()
        go = threading.Event()

        def one():
            go.wait()
            resp = envoy.post("/orders", BODY, key_headers(new_key()), timeout=30)
            with lock:
                statuses.append(resp.status)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(BURST)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(60)
        made = settled_authenticates(etcd) - before
        print("burst of %d new keys: %d authenticate calls, statuses %s"
              % (BURST, made, sorted(set(statuses))))
        assert statuses == [201] * BURST, statuses
        # One fetch per worker at a time; the worker count bounds it.
        assert made <= envoy.concurrency, made
    finally:
        envoy.stop()
