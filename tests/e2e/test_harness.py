"""Self-test of the plumbing, with Envoy running WITHOUT the filter: proxying to the upstream,
the upstream's knobs and counters, the raw client, stats, logs. If these fail, the other
modules' failures say nothing about the filter."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import harness
from harness import build_request, expected_body, new_key

FILTER_CONFIG = None  # no wasm filter: plain Envoy + router
ENVOY_OPTIONS = {"extra_routes": [harness.route("/short-timeout", timeout="0.5s")]}


def test_proxies_to_upstream_and_counts_executions(envoy, upstream):
    key = new_key()
    r1 = envoy.post("/orders", {"amount": 1}, {"idempotency-key": key})
    r2 = envoy.post("/orders", {"amount": 1}, {"idempotency-key": key})
    assert r1.status == r2.status == 201, (r1, r2)
    assert r1.header("content-type") == "application/json"
    doc = r1.json()
    assert doc["path"] == "/orders" and doc["method"] == "POST"
    assert doc["received_bytes"] == len(b'{"amount":1}')
    assert r1.header("x-execution") == str(doc["order_id"])
    assert r1.header("set-cookie") == "session=%s" % doc["order_id"]
    assert int(r2.header("x-execution")) > int(r1.header("x-execution"))
    assert not r1.replayed and not r2.replayed
    assert upstream.executions(key) == 2
    reqs = upstream.requests(key)
    assert [r["body_sha256"] for r in reqs] == [hashlib.sha256(b'{"amount":1}').hexdigest()] * 2


def test_path_counter_and_query(envoy, upstream):
    path = "/orders/" + new_key()
    assert envoy.post(path + "?a=1", b"x").status == 201
    assert upstream.path_executions(path) == 1


def test_status_knob_and_no_body_statuses(envoy):
    for status in (200, 302, 400, 409, 425, 429, 500, 503):
        r = envoy.post("/orders", b"{}", {"x-status": str(status)})
        assert r.status == status, r
    r = envoy.post("/orders", b"{}", {"x-status": "204"})
    assert r.status == 204 and r.body == b""


def test_response_bytes_knob_is_deterministic(envoy):
    r = envoy.post("/orders", b"", {"x-response-bytes": "300000"})
    assert r.status == 201
    n = int(r.header("x-execution"))
    assert r.body == expected_body(n, 300000)
    assert r.body.startswith(b"execution=%d;" % n)


def test_chunked_response_with_trailers_through_envoy(envoy):
    r = envoy.raw("POST", "/orders", [("x-trailers", "1"), ("x-response-bytes", "5000")], b"{}")
    assert r.status == 201 and r.complete
    assert r.header("transfer-encoding") == "chunked"
    assert r.body == expected_body(int(r.header("x-execution")), 5000)
    assert r.trailer("x-checksum") == "sha256=" + hashlib.sha256(r.body).hexdigest()


def test_chunked_response_without_trailers(envoy):
    r = envoy.raw("POST", "/orders", [("x-chunked", "1")], b"{}")
    assert r.status == 201 and r.complete and r.trailers == []
    assert r.json()["received_bytes"] == 2


def test_chunked_request_body(envoy, upstream):
    key = new_key()
    r = envoy.raw("POST", "/orders", [("idempotency-key", key)], chunks=[b"hello ", b"world"] * 3)
    assert r.status == 201, r
    assert r.json()["received_bytes"] == 33
    assert upstream.requests(key)[0]["body_sha256"] == hashlib.sha256(b"hello world" * 3).hexdigest()


def test_raw_client_sends_what_http_client_refuses(envoy, upstream):
    # repeated header, non-ASCII byte in a value: forwarded as sent when no filter interferes
    key = new_key()
    r = envoy.raw("POST", "/orders", [("idempotency-key", key), ("idempotency-key", key)], b"{}")
    assert r.status == 201, r
    assert upstream.executions(key + ", " + key) == 1
    key2 = new_key()
    r = envoy.raw("POST", "/orders", [(b"idempotency-key", key2.encode() + b"\xe9")], b"{}")
    assert r.status == 201, r
    assert upstream.executions(key2 + "\xe9") == 1


def test_unreachable_route_is_envoys_503(envoy, upstream):
    before = upstream.total()
    r = envoy.post("/unreachable/x", b"{}")
    assert r.status == 503, r
    assert upstream.total() == before
    assert envoy.counter("cluster.unreachable.upstream_cx_connect_fail") >= 1


def test_upstream_reset_knobs(envoy):
    r = envoy.post("/orders", b"{}", {"x-reset": "before-headers"})
    assert r.status == 503, r  # Envoy: upstream reset before headers
    r = envoy.raw("POST", "/orders", [("x-reset", "mid-body")], b"{}")
    assert r.status == 201 and not r.complete, r


def test_route_timeout_is_a_504(envoy):
    r = envoy.post("/short-timeout", b"{}", {"x-delay-ms": "3000"})
    assert r.status == 504, r
    assert envoy.counter("cluster.orders.upstream_rq_timeout") >= 1


def test_client_disconnects(envoy, upstream):
    key = new_key()
    data = build_request("POST", "/orders", [("idempotency-key", key), ("content-length", "1000")])
    harness.send_and_disconnect(envoy.port, data + b"x" * 100)
    # a client that goes away in the middle of a response
    data = build_request("POST", "/orders", [("x-response-bytes", "1000000")], b"{}")
    got = harness.read_partial_and_disconnect(envoy.port, data, 1000)
    assert got.startswith(b"HTTP/1.1 201")
    # Envoy is fine afterwards, and the half-sent request never reached the upstream
    assert envoy.post("/orders", b"{}").status == 201
    assert upstream.executions(key) == 0


def test_parallel_connections_reach_both_workers(envoy):
    before = envoy.stats(filter=r"^listener\.127\.0\.0\.1_\d+\.worker_\d+\.downstream_cx_total$")
    results = []

    def one():
        results.append(envoy.post("/orders", b"{}", {"x-delay-ms": "100"}).status)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [201] * 20
    after = envoy.stats(filter=r"^listener\.127\.0\.0\.1_\d+\.worker_\d+\.downstream_cx_total$")
    grew = [k for k in after if after[k] > before.get(k, 0)]
    assert len(grew) == 2, after


def test_stats_prometheus_and_log(envoy):
    before = envoy.counter("http.ingress_http.downstream_rq_total")
    envoy.post("/orders", b"{}")
    assert envoy.wait_counter("http.ingress_http.downstream_rq_total", before + 1) >= before + 1
    stats = envoy.stats()
    assert stats["cluster.orders.upstream_rq_total"] >= 1
    assert envoy.filter_counters() == {}  # no filter loaded here
    assert "envoy_cluster_upstream_rq_total" in envoy.prometheus()
    assert "starting main dispatch loop" in envoy.log_text()


def test_upstream_admin_reset_and_restart(tmp_path):
    up = harness.Upstream("private-upstream", log_dir=tmp_path).start()
    try:
        harness.request(up.port, "POST", "/orders", b"{}", {"idempotency-key": "k"})
        assert up.executions("k") == 1
        assert up.executions() == {"total": 1, "by_key": {"k": 1}, "by_path": {"/orders": 1}}
        up.reset()
        assert up.executions() == {"total": 0, "by_key": {}, "by_path": {}}
        assert up.stderr_text() == ""  # quiet
    finally:
        up.stop()
    assert up.proc.poll() is not None


def test_render_with_filter_is_valid_json():
    env = harness.Envoy("envoy", 1, {"routes": []}, wasm_path="x.wasm")
    try:
        cfg = json.loads(json.dumps(env.render()))
        hf = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]["http_filters"]
        assert [f["name"] for f in hf] == ["idempotency", "envoy.filters.http.router"]
        value = hf[0]["typed_config"]["config"]["configuration"]["value"]
        assert json.loads(value) == {"routes": []}
    finally:
        env.closed_port.close()


# ---- plumbing: filters around the (absent) idempotency filter, Envoy-made answers ----


def _plain_envoy(envoy_bin, upstream, name, **options):
    return harness.Envoy(envoy_bin, upstream.port, None, name=name, concurrency=1, **options)


def test_jwt_authn_in_front_verifies_hs256_tokens(envoy_bin, upstream):
    secret = b"harness-secret-0123456789abcdef0123"
    issuer = "https://issuer.harness.test"
    pre = [harness.jwt_authn_filter(issuer, secret, "jwt_payload")]
    now = int(time.time())
    claims = {"iss": issuer, "sub": "u1", "iat": now, "exp": now + 600, "jti": new_key()}
    with _plain_envoy(envoy_bin, upstream, "harness-jwt", pre_filters=pre) as proxy:
        key = new_key()
        good = proxy.post("/orders", b"{}", {"idempotency-key": key, "authorization":
                                             "Bearer " + harness.mint_hs256(secret, claims)})
        assert good.status == 201, good
        none = proxy.post("/orders", b"{}", {"idempotency-key": key})
        assert none.status == 201, none  # allow_missing
        forged = proxy.post("/orders", b"{}", {"idempotency-key": key, "authorization":
                                               "Bearer " + harness.mint_hs256(b"x" * 32, claims)})
        assert forged.status == 401, forged
        assert upstream.executions(key) == 2


def test_direct_response_route_and_local_ratelimit_after(envoy_bin, upstream):
    routes = [harness.direct_response("/direct", 201, '{"direct":true}'),
              harness.route("/limited", per_filter=harness.local_ratelimit_route(1, "60s"))]
    with _plain_envoy(envoy_bin, upstream, "harness-local", extra_routes=routes,
                      post_filters=[harness.local_ratelimit_filter()]) as proxy:
        key = new_key()
        d = proxy.post("/direct/x", b"{}", {"idempotency-key": key})
        assert d.status == 201 and d.body == b'{"direct":true}', d
        assert upstream.executions(key) == 0
        statuses = [proxy.post("/limited", b"{}", {"idempotency-key": key}).status
                    for _ in range(3)]
        assert statuses == [201, 429, 429], statuses
        assert upstream.executions(key) == 1
        # other routes are not limited
        assert [proxy.post("/orders", b"{}").status for _ in range(3)] == [201] * 3


def test_upstream_content_type_knobs(envoy, upstream):
    r = envoy.post("/orders", b"{}", {"x-no-content-type": "1"})
    assert r.status == 201 and r.header("content-type") is None and r.body, r
    r = envoy.post("/orders", b"{}", {"x-content-type": "application/json",
                                      "x-response-bytes": "0"})
    assert r.status == 201 and r.header("content-type") == "application/json", r
    assert r.body == b"" and r.header("content-length") == "0", r
    r = envoy.raw("HEAD", "/orders")
    assert r.status == 201 and r.body == b"", r
    assert int(r.header("content-length")) > 0 and r.header("content-type") == "application/json"


def test_upstream_body_pause_knob(envoy, upstream):
    t0 = time.monotonic()
    r = envoy.post("/orders", b"{}", {"x-response-bytes": "5000", "x-body-pause-ms": "300"})
    assert r.status == 201 and time.monotonic() - t0 >= 0.3, r
    assert r.body == expected_body(int(r.header("x-execution")), 5000)


def test_free_port_never_hands_out_one_port_twice(monkeypatch):
    # The kernel gave one port to two binds in a row, and an etcd got it as both its client and
    # its peer port (bind: address already in use). Replay that kernel.
    import socket as socket_module

    from idemkit import process

    kernel_ports = iter([47001, 47001, 47002])

    class KernelSocket:
        def __init__(self, *args):
            self.port = None

        def bind(self, addr):
            self.port = next(kernel_ports)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(process, "_HANDED_OUT", set(), raising=False)
    monkeypatch.setattr(socket_module, "socket", KernelSocket)
    assert [process.free_port(), process.free_port()] == [47001, 47002]


def test_a_test_etcd_keeps_its_data_on_tmpfs_and_a_benchmark_etcd_on_disk(tmp_path):
    # A slow disk's fsync (3.4 s, seen on CI) turned a test etcd's answers into the store's
    # timeouts; the benchmarks measure etcd with its fsync.
    import os

    from idemkit.etcd import Etcd

    assert os.path.isdir("/dev/shm"), "this machine has no tmpfs at /dev/shm"
    test_etcd = Etcd("harness-tmpfs", log_dir=tmp_path).start()
    try:
        assert str(test_etcd.data_dir).startswith("/dev/shm/"), test_etcd.data_dir
        assert test_etcd.healthy()
    finally:
        test_etcd.stop()
    assert not Etcd("harness-disk", log_dir=tmp_path, durable=True)._data_root()
