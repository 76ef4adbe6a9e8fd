"""Which module runs, as a real Envoy shows it (docs/OPERATIONS.md, "Which version runs"; no
contract row: a promise to the operator). The version is Cargo.toml's (src/build_info.rs takes
it from the build). With the stats tags of the shipped envoy/envoy.yaml, /stats/prometheus shows
`idempotency_build_info{version="<version>"} 1`, one series of a gauge family, whatever the
number of workers and after traffic; Envoy's log says `idempotency-filter <version> started`
once, although every VM's root runs the start (Envoy runs 4 VMs here: the canary, the main
thread, two workers), and still once after a configuration update started new roots in them.
Without the tags: test_metrics.py."""

from __future__ import annotations

import copy
import json
import os
import re
import tomllib

import harness
from harness import REPO_ROOT, new_key
from idemkit import bootstrap
from idemkit.bootstrap import shipped_stats_config
from idemkit.envoy import Envoy as _Envoy
from idemkit.process import ClosedPort, free_port

with open(REPO_ROOT / "Cargo.toml", "rb") as _f:
    VERSION = tomllib.load(_f)["package"]["version"]
STARTED = "idempotency-filter %s started" % VERSION
GAUGE_STAT = harness.STAT_PREFIX + "build_info.version." + VERSION

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}
ENVOY_OPTIONS = {"stats_config": shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml"),
                 "component_log_level": "wasm:info"}


def _started_lines(proxy) -> list[str]:
    return [line for line in proxy.log_text().splitlines() if "idempotency-filter " in line and " started" in line]


def test_the_version_is_one_gauge_series_and_one_log_line(envoy):
    key = new_key()
    headers = {"content-type": "application/json", "idempotency-key": key}
    assert envoy.post("/orders", b"{}", headers).status == 201
    assert envoy.post("/orders", b"{}", headers).replayed
    envoy.wait_counter("stored", 1)

    text = envoy.prometheus()
    assert "# TYPE idempotency_build_info gauge" in text
    series = re.findall(r"^idempotency_build_info(\{[^}]*\})? (\S+)$", text, re.M)
    assert series == [('{version="%s"}' % VERSION, "1")], series
    # In /stats: one gauge at 1, set by every VM's root, not added up over them.
    assert envoy.stats()[GAUGE_STAT] == 1

    # Several roots started (each configures itself and says so), one said the version.
    assert envoy.log_text().count("configured 1 route rule(s)") >= 3
    lines = _started_lines(envoy)
    assert len(lines) == 1, lines
    assert lines[0].endswith(STARTED) and "[info]" in lines[0], lines


class ReloadableEnvoy(_Envoy):
    """The e2e proxy with its listener in `<log_dir>/lds.json` (file-based LDS), so that a new
    listener file is a configuration update: new root contexts in the running VMs."""

    log_root = harness.LOG_ROOT

    def __init__(self, envoy_bin, upstream_port, wasm_path, name):
        self.closed_port = ClosedPort()
        self.wasm_path = wasm_path
        config = bootstrap.orders_proxy(upstream_port, self.closed_port.port, FILTER_CONFIG, wasm_path,
                                        stats_config=ENVOY_OPTIONS["stats_config"])
        self.listener = config["static_resources"].pop("listeners")[0]
        self.listener["address"] = bootstrap.socket_address(free_port())
        super().__init__(envoy_bin, config, name, component_log_level="wasm:info")
        self.lds_path = self.log_dir / "lds.json"
        config["dynamic_resources"] = {"lds_config": {"path_config_source": {"path": str(self.lds_path)},
                                                      "resource_api_version": "V3"}}
        config["node"] = {"id": "build-info", "cluster": "e2e"}
        self.write_listener(FILTER_CONFIG)

    def write_listener(self, filter_config: dict) -> None:
        listener = copy.deepcopy(self.listener)
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [bootstrap.filter_http_filter(filter_config, self.wasm_path), bootstrap.router()]
        listener["@type"] = "type.googleapis.com/envoy.config.listener.v3.Listener"
        tmp = self.lds_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"resources": [listener]}))
        os.replace(tmp, self.lds_path)  # Envoy watches the file for a move into place

    def stop(self):
        rc = super().stop()
        self.closed_port.close()
        return rc


def test_a_configuration_update_keeps_one_log_line_and_the_gauge(envoy_bin, filter_wasm, upstream):
    proxy = ReloadableEnvoy(envoy_bin, upstream.port, filter_wasm, "build-info-reload").start()
    try:
        assert proxy.post("/orders", b"{}", {"idempotency-key": new_key()}).status == 201
        configured = proxy.log_text().count("configured 1 route rule(s)")
        assert configured >= 3 and len(_started_lines(proxy)) == 1, proxy.log_text()[-3000:]

        updates = proxy.counter("listener_manager.lds.update_success")
        changed = copy.deepcopy(FILTER_CONFIG)
        changed["routes"][0]["ttl"] = "1h"
        proxy.write_listener(changed)
        harness.wait_until(lambda: proxy.counter("listener_manager.lds.update_success") > updates, 5,
                           what="the listener update")
        harness.wait_until(lambda: proxy.log_text().count("configured 1 route rule(s)") > configured, 5,
                           what="the new roots")
        assert proxy.post("/orders", b"{}", {"idempotency-key": new_key()}).status == 201

        # New roots started (and configured) in the running VMs; the version was said once.
        assert len(_started_lines(proxy)) == 1, _started_lines(proxy)
        assert proxy.stats()[GAUGE_STAT] == 1
        assert 'idempotency_build_info{version="%s"} 1' % VERSION in proxy.prometheus().splitlines()
    finally:
        proxy.stop()
