"""Which module runs, as a real Envoy shows it (docs/OPERATIONS.md, "Which version runs"; no
contract row: a promise to the operator). The version is Cargo.toml's, the revision the commit
that last changed the module's sources (src/build_info.rs takes both from the build;
deploy/oci/revision.py finds the revision). With the stats tags of the shipped envoy/envoy.yaml,
/stats/prometheus shows `idempotency_build_info{version="<version>",revision="<revision>"} 1`,
one series of a gauge family, whatever the number of workers and after traffic; Envoy's log says
`idempotency-filter <version> (revision <revision>) started` once, although every VM's root runs the start (Envoy runs 4 VMs here: the canary, the main
thread, two workers), and still once after a configuration update started new roots in them.
Without the tags: test_metrics.py."""

from __future__ import annotations

import copy
import json
import os
import re
import harness
from harness import REPO_ROOT, new_key
from idemkit import bootstrap, module_revision, module_version
from idemkit.bootstrap import shipped_stats_config
from idemkit.envoy import Envoy as _Envoy
from idemkit.process import ClosedPort, free_port

VERSION = module_version()
REVISION = module_revision()
STARTED = "idempotency-filter %s (revision %s) started" % (VERSION, REVISION)
GAUGE_STAT = harness.STAT_PREFIX + "build_info.version.%s.revision.%s" % (VERSION, REVISION)
LABELS = '{version="%s",revision="%s"}' % (VERSION, REVISION)

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
    assert series == [(LABELS, "1")], series
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
        assert "idempotency_build_info%s 1" % LABELS in proxy.prometheus().splitlines()
    finally:
        proxy.stop()


def test_the_revision_is_that_of_the_module_built_here(filter_wasm):
    """The module make build wrote carries this checkout's revision: the e2e suite runs on a
    committed tree (CI's clean clone), where it is a commit, never `unknown`."""
    assert REVISION in filter_wasm.read_bytes().decode("latin-1"), REVISION
    if REVISION != "unknown":
        assert len(REVISION) == 12 and all(c in "0123456789abcdef" for c in REVISION), REVISION


def test_the_version_tag_of_earlier_configs_keeps_the_revision_in_the_version(envoy_bin, filter_wasm, upstream):
    """A bootstrap that kept 0.2.0's `version` tag alone (OPERATIONS.md's table says what to
    change): the version label runs on to the revision; nothing is lost or refused."""
    old = {"stats_tags": [{"tag_name": "version",
                           "regex": "^wasmcustom\\.idempotency\\.build_info(\\.version\\.(.+))$"}]}
    closed = ClosedPort()
    config = bootstrap.orders_proxy(upstream.port, closed.port, FILTER_CONFIG, filter_wasm, stats_config=old)
    proxy = _Envoy(envoy_bin, config, "build-info-old-tag").start()
    try:
        assert 'idempotency_build_info{version="%s.revision.%s"} 1' % (VERSION, REVISION) in \
            proxy.prometheus().splitlines(), [line for line in proxy.prometheus().splitlines() if "build_info" in line]
    finally:
        proxy.stop()
        closed.close()
