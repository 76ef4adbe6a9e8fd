"""C9 across a configuration update: it does not drop the completions a worker's root carries.

A real Envoy takes its listener from a file (file-based LDS) and its etcd through a proxy that
holds answers back. A request's 201 comes back from the upstream and its completion is on its
way to etcd when the client leaves; then the listener file is replaced with another filter
configuration. Envoy retires the old root context: before, it was deleted at once and its
callouts cancelled, the record stayed in flight, and a retry after the lease executed again.
Now the old root finishes the completion first (it answers `on_done` with false and calls
`proxy_done` once drained), so the retry is the replay.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import time

import harness
from harness import key_headers, new_key
from idemkit import bootstrap
from idemkit.envoy import Envoy as _Envoy
from idemkit.process import ClosedPort, free_port

BODY = b'{"item":"book","qty":1}'
LEASE_S = 3
# Longer than the proxy's hold, so the completion is in flight (not timed out) at the reload.
STORE_TIMEOUT = "4s"
HOLD_S = 1.5


def filter_config(note: str) -> dict:
    return {
        "store": harness.etcd_store(prefix="/e2e-reload/", timeout=STORE_TIMEOUT),
        "routes": [{"name": "orders-" + note, "match": {"prefix": "/orders"}, "require_key": True,
                    "processing_timeout": "%ds" % LEASE_S}],
    }


class ReloadableEnvoy(_Envoy):
    """The e2e proxy with its listener in `<log_dir>/lds.json` (file-based LDS), on a fixed
    port so that a new listener file updates it in place."""

    log_root = harness.LOG_ROOT

    def __init__(self, envoy_bin, upstream_port, etcd_port, wasm_path, name):
        self.closed_port = ClosedPort()
        self.wasm_path = wasm_path
        config = bootstrap.orders_proxy(
            upstream_port, self.closed_port.port, filter_config("a"), wasm_path,
            extra_clusters=[harness.etcd_cluster([etcd_port], health_checks=False)],
        )
        self.listener = config["static_resources"].pop("listeners")[0]
        self.listener["address"] = bootstrap.socket_address(free_port())
        super().__init__(envoy_bin, config, name)
        self.lds_path = self.log_dir / "lds.json"
        config["dynamic_resources"] = {
            "lds_config": {"path_config_source": {"path": str(self.lds_path)},
                           "resource_api_version": "V3"},
        }
        config["node"] = {"id": "reload", "cluster": "e2e"}
        self.write_listener(filter_config("a"))

    def write_listener(self, config: dict) -> None:
        listener = copy.deepcopy(self.listener)
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [
            bootstrap.filter_http_filter(config, self.wasm_path), bootstrap.router()
        ]
        listener["@type"] = "type.googleapis.com/envoy.config.listener.v3.Listener"
        # Envoy watches the file for a move into place.
        tmp = self.lds_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"resources": [listener]}))
        os.replace(tmp, self.lds_path)

    def stop(self):
        rc = super().stop()
        self.closed_port.close()
        return rc



FILTER_CONFIG = filter_config("a")  # the module's Envoy is built by the test itself


def test_a_configuration_update_finishes_the_completion_in_flight(envoy_bin, filter_wasm, upstream,
                                                                  etcd):
    delay = harness.DelayProxy(etcd.client_port, delay=0.0)
    proxy = ReloadableEnvoy(envoy_bin, upstream.port, delay.port, filter_wasm, "reload").start()
    try:
        assert proxy.post("/orders", BODY, key_headers(new_key())).status == 201
        key = new_key()
        data = harness.build_request("POST", "/orders", key_headers(key, **{"x-delay-ms": "300"}),
                                     BODY)
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        client.sendall(data)
        harness.wait_until(lambda: upstream.executions(key) == 1, 5, what="the execution")
        # The upstream answers in 300 ms; its completion's etcd answers are held back.
        delay.delay = HOLD_S
        time.sleep(0.6)
        # The client leaves while its response waits for the record to be written.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()
        updates = proxy.counter("listener_manager.lds.update_success")
        proxy.write_listener(filter_config("b"))
        harness.wait_until(
            lambda: proxy.counter("listener_manager.lds.update_success") > updates, 5,
            what="the listener update")
        # Whether or not the old root finishes it, give the completion its time, then answer
        # promptly again.
        try:
            proxy.wait_counter("stored", 2, timeout=4 * HOLD_S + 2)
        except AssertionError:
            pass
        delay.delay = 0.0
        time.sleep(LEASE_S + 0.3)
        retry = proxy.post("/orders", BODY, key_headers(key, **{"x-delay-ms": "300"}))
        assert retry.status == 201 and retry.replayed, retry
        assert upstream.executions(key) == 1
        assert proxy.idem("stored") == 2
        assert proxy.idem("settlement_abandoned") == 0
        assert "configuration retired: finishing 1 store operation(s) first" in proxy.log_text()
    finally:
        proxy.stop()
        delay.close()
