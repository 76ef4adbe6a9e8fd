"""istio/: the WasmPlugin and EnvoyFilter forms for an ingress gateway (istio/gateway) and
mesh-wide in the root namespace (istio/mesh). Each manifest parses; the image is the one
`make oci` tags; every plugin configuration is accepted by the filter's own parser (and the
parser is shown to refuse a broken one); the two forms of a directory carry the same
configuration; and each EnvoyFilter's Wasm typed_config, with the module as the local file
istio-agent turns the oci:// URL into, passes `envoy --mode validate` in a minimal bootstrap and,
run for real against etcd and the demo upstream, serves a first call and its replay (C8, C9). And
istio/stats-tags.yaml, the bootstrap override that gives the counters their route and outcome
labels on Istio: applied to Istio's own bootstrap stats_config (rendered from its template, see
istio_bootstrap.py), it keeps Istio's tags and adds ours, and a real Envoy with both shows
idempotency_requests_total{route,outcome} and idempotency_build_info{version}."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import re

import pytest

import istio_bootstrap
from conftest import envoy_validate
from idemkit import REPO_ROOT, bootstrap, module_revision
from idemkit.client import request
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd
from idemkit.process import ClosedPort, Upstream
from manifests import ISTIO_DIR, RBAC_TYPE, WASM_TYPE, as_json, check_configs, crate_version, load, load_all

# The filter's manifests, one directory per form; istio/stats-tags.yaml beside them.
FILES = sorted(p.relative_to(ISTIO_DIR).as_posix() for p in ISTIO_DIR.glob("*/*.yaml"))
STATS_TAGS_FILE = ISTIO_DIR / "stats-tags.yaml"
DIRS = ("gateway", "mesh")


def _doc(rel: str) -> dict:
    docs = load_all(ISTIO_DIR / rel)
    assert len(docs) == 1, rel
    return docs[0]


ADMIN_EXTENSION = "istio-system.idempotency-admin"


def _extension_config(doc: dict, name: str | None = None) -> dict:
    """The EXTENSION_CONFIG patch's value named `name`; without one, the data plane's (the one
    that is not the admin API's, mesh/envoyfilter.yaml)."""
    patches = [p for p in doc["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"
               and (p["patch"]["value"]["name"] == name if name else p["patch"]["value"]["name"] != ADMIN_EXTENSION)]
    assert len(patches) == 1 and patches[0]["patch"]["operation"] == "ADD"
    return patches[0]["patch"]["value"]


def _configurations() -> dict[str, str]:
    """{file: the JSON text the filter receives}: a WasmPlugin's pluginConfig (Istio passes it
    as JSON), an EnvoyFilter's configuration string."""
    out = {}
    for rel in FILES:
        doc = _doc(rel)
        if doc["kind"] == "WasmPlugin":
            out[rel] = as_json(doc["spec"]["pluginConfig"])
        else:
            cfg = _extension_config(doc)["typed_config"]["config"]["configuration"]
            assert cfg["@type"] == "type.googleapis.com/google.protobuf.StringValue"
            out[rel] = cfg["value"]
    return out


def test_the_manifests_parse():
    assert FILES == ["gateway/envoyfilter.yaml", "gateway/wasmplugin.yaml",
                     "mesh/envoyfilter.yaml", "mesh/wasmplugin.yaml",
                     "workloads/namespace-envoyfilter.yaml", "workloads/payments-envoyfilter.yaml"]
    for rel in FILES:
        doc = _doc(rel)
        expected = {"WasmPlugin": "extensions.istio.io/v1alpha1",
                    "EnvoyFilter": "networking.istio.io/v1alpha3"}
        assert doc["apiVersion"] == expected[doc["kind"]], rel
        assert doc["metadata"]["name"] and doc["metadata"]["namespace"], rel
    # Mesh-wide means Istio's root namespace, narrowed by a workload selector.
    for rel in ("mesh/envoyfilter.yaml", "mesh/wasmplugin.yaml"):
        assert _doc(rel)["metadata"]["namespace"] == "istio-system"
    assert (_doc("mesh/envoyfilter.yaml")["spec"]["workloadSelector"]["labels"]
            == _doc("mesh/wasmplugin.yaml")["spec"]["selector"]["matchLabels"])
    assert (_doc("gateway/envoyfilter.yaml")["spec"]["workloadSelector"]["labels"]
            == _doc("gateway/wasmplugin.yaml")["spec"]["selector"]["matchLabels"])


def _image_tag(url: str) -> str:
    """The tag of an image reference pinned by digest (`oci://.../idempotency-filter:<tag>@sha256:<hex>`,
    deploy/oci/pin.py; test_oci.py checks the digest is the one make oci builds)."""
    assert url.startswith("oci://"), url
    name, at, digest = url.partition("@")
    assert at and re.fullmatch(r"sha256:[0-9a-f]{64}", digest), "not pinned by digest: %s" % url
    return name.rsplit(":", 1)[1]


@pytest.mark.parametrize("rel", [f for f in FILES if f.endswith("wasmplugin.yaml")])
def test_wasmplugin(rel):
    spec = _doc(rel)["spec"]
    # After jwt_authn (the principal is verified), not before.
    assert spec["phase"] == "AUTHZ"
    # A crashed VM is replaced, as the EnvoyFilter form's failure_policy (Istio 1.27+).
    assert spec["failStrategy"] == "FAIL_RELOAD"
    assert spec["imagePullPolicy"] in ("IfNotPresent", "Always")
    assert _image_tag(spec["url"]) == crate_version()  # the tag `make oci` writes
    assert spec["selector"]["matchLabels"]
    assert spec["pluginName"] == "idempotency"
    if rel.startswith("mesh/"):
        assert spec["match"] == [{"mode": "SERVER"}]


@pytest.mark.parametrize("rel", [f for f in FILES if f.endswith("envoyfilter.yaml")])
def test_envoyfilter_sets_what_a_wasmplugin_cannot(rel):
    spec = _doc(rel)["spec"]
    # A namespace-wide rollout selects every workload of its namespace: no selector.
    assert spec.get("workloadSelector", {}).get("labels") or rel == "workloads/namespace-envoyfilter.yaml"
    ext = _extension_config(_doc(rel))
    assert ext["typed_config"]["@type"] == WASM_TYPE
    config = ext["typed_config"]["config"]
    assert config["allow_on_headers_stop_iteration"] is True
    assert config["vm_config"]["vm_id"] == "idempotency"
    assert config["failure_policy"] == "FAIL_RELOAD"
    assert _image_tag(config["vm_config"]["code"]["remote"]["http_uri"]["uri"]) == crate_version()
    filters = [p for p in spec["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    assert len(filters) == 1
    patch = filters[0]
    assert patch["match"]["context"] == ("GATEWAY" if rel.startswith("gateway/") else "SIDECAR_INBOUND")
    # Right before the router: after jwt_authn and RBAC.
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["patch"]["value"]["name"] == ext["name"]
    # Istio's own WasmPlugin filters list both: a failed image pull becomes an RBAC filter.
    assert patch["patch"]["value"]["config_discovery"]["type_urls"] == [WASM_TYPE, RBAC_TYPE]


@pytest.mark.parametrize("rel", FILES)
def test_every_manifest_states_the_istio_floor(rel):
    """Istio 1.27 accepts the EnvoyFilter form and drops allow_on_headers_stop_iteration (its
    go-control-plane lacks the field): each manifest's header says the floor, and
    docs/DEPLOYMENT.md gives the evidence."""
    text = (ISTIO_DIR / rel).read_text()
    header = text[:text.index("\napiVersion:")]
    assert re.search(r"ISTIO >= 1\.28|Istio >= 1\.28", header), header
    assert "1.27" in header and "allow_on_headers_stop_iteration" in header, header
    assert 'docs/DEPLOYMENT.md, "Istio version floor"' in re.sub(r"\s*\n#\s*", " ", header), header
    deployment = (REPO_ROOT / "docs" / "DEPLOYMENT.md").read_text()
    section = deployment[deployment.index("**Istio version floor: 1.28 for the EnvoyFilter form.**"):]
    for evidence in ("BuildXDSObjectFromStruct", "2025-07-15", "v1.32.5-0.20250627145903-197b96a9c7f8",
                     "v1.35.1-0.20251009075907-cccc37f025be", "body_never_received"):
        assert evidence in section.split("\n\n**")[0], evidence


def test_every_configuration_is_accepted_by_the_filter(check_config, tmp_path):
    results = check_configs(check_config, _configurations(), tmp_path)
    assert all(line.startswith("ok ") for line in results.values()), results


def test_the_parser_check_refuses_a_broken_configuration(check_config, tmp_path):
    # The check above can fail: the same configuration with one bad field is refused, by name.
    cfg = json.loads(_configurations()["gateway/wasmplugin.yaml"])
    cfg["routes"][0]["ttl"] = "24x"
    results = check_configs(check_config, {"broken": as_json(cfg)}, tmp_path)
    assert results["broken"].startswith("error ") and "routes[0].ttl" in results["broken"], results


@pytest.mark.parametrize("directory", DIRS)
def test_both_forms_carry_the_same_configuration(directory):
    configs = _configurations()
    assert (json.loads(configs[directory + "/envoyfilter.yaml"])
            == json.loads(configs[directory + "/wasmplugin.yaml"]))


def _bootstrap(rel: str, wasm: Path, upstream_port: int, etcd_port: int) -> dict:
    """A minimal Envoy around the EnvoyFilter's typed_config: the module as a local file (what
    istio-agent does with the oci:// URL), Istio's etcd cluster name on a local etcd."""
    ext = copy.deepcopy(_extension_config(_doc(rel)))
    ext["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": str(wasm)}}
    etcd_name = json.loads(ext["typed_config"]["config"]["configuration"]["value"])["store"]["cluster"]
    routes = [bootstrap.route("/", timeout="15s")]
    hcm = bootstrap.http_connection_manager(routes, [{"name": ext["name"], "typed_config": ext["typed_config"]}])
    clusters = [bootstrap.cluster("orders", upstream_port), bootstrap.etcd_cluster([etcd_port], name=etcd_name)]
    return bootstrap.bootstrap(hcm, clusters)


@pytest.mark.parametrize("rel", [f for f in FILES if f.endswith("envoyfilter.yaml")])
def test_envoyfilter_typed_config_validates(rel, envoy_bin, filter_wasm, tmp_path):
    path = tmp_path / "bootstrap.json"
    path.write_text(json.dumps(_bootstrap(rel, filter_wasm, 8080, 2379)))
    proc = envoy_validate(envoy_bin, path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout + proc.stderr


def _admin_listener(wasm: Path) -> dict:
    """mesh/envoyfilter.yaml's admin listener as Envoy gets it: its ECDS filter given the admin
    EXTENSION_CONFIG inline, the module as a local file, on a free port."""
    doc = _doc("mesh/envoyfilter.yaml")
    [patch] = [p for p in doc["spec"]["configPatches"] if p["applyTo"] == "LISTENER"]
    listener = copy.deepcopy(patch["patch"]["value"])
    ext = copy.deepcopy(_extension_config(doc, ADMIN_EXTENSION))
    ext["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": str(wasm)}}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0] = {"name": ext["name"], "typed_config": ext["typed_config"]}
    listener["address"]["socket_address"]["port_value"] = 0
    return listener


def test_the_mesh_ships_the_admin_api_in_every_sidecar():
    """Issue 47: the admin listener in the sidecar, on its loopback, the same module, vm_id and
    root_id as the data plane (so it reads the same records), the same store, a token required."""
    doc = _doc("mesh/envoyfilter.yaml")
    [patch] = [p for p in doc["spec"]["configPatches"] if p["applyTo"] == "LISTENER"]
    assert patch["patch"]["operation"] == "ADD" and patch["match"]["context"] == "SIDECAR_OUTBOUND"
    listener = patch["patch"]["value"]
    assert listener["address"]["socket_address"]["address"] == "127.0.0.1"
    admin, data = _extension_config(doc, ADMIN_EXTENSION)["typed_config"]["config"], _extension_config(doc)["typed_config"]["config"]
    for field in ("name", "root_id", "failure_policy"):
        assert admin[field] == data[field], field
    assert admin["vm_config"] == data["vm_config"]
    admin_cfg, data_cfg = (json.loads(c["configuration"]["value"]) for c in (admin, data))
    assert admin_cfg["store"] == data_cfg["store"]
    assert re.fullmatch(r"[0-9a-f]{64}", admin_cfg["admin"]["token_sha256"])
    [hcm] = listener["filter_chains"][0]["filters"]
    first = hcm["typed_config"]["http_filters"][0]
    assert first["name"] == ADMIN_EXTENSION
    assert first["config_discovery"]["type_urls"] == [WASM_TYPE, RBAC_TYPE]
    assert "wasm.idempotency.audit" in json.dumps(hcm["typed_config"]["access_log"])


def test_the_sidecar_admin_api_reads_the_fleets_records(envoy_bin, filter_wasm, check_config, tmp_path):
    """The admin listener, as the mesh manifest ships it, beside the data plane on one Envoy over
    etcd: a record the data plane wrote is listed by key with the token, and refused without."""
    admin_cfg = _extension_config(_doc("mesh/envoyfilter.yaml"), ADMIN_EXTENSION)["typed_config"]["config"]
    results = check_configs(check_config, {"admin": admin_cfg["configuration"]["value"]}, tmp_path)
    assert results["admin"].startswith("ok "), results
    token = "t-" + uuid.uuid4().hex
    up = Upstream("istio-admin-orders").start()
    etcd = Etcd("istio-admin-etcd").start()
    proxy = None
    try:
        cfg = _bootstrap("mesh/envoyfilter.yaml", filter_wasm, up.port, etcd.client_port)
        listener = _admin_listener(filter_wasm)
        wasm_cfg = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]["typed_config"]["config"]
        value = json.loads(wasm_cfg["configuration"]["value"])
        value["admin"]["token_sha256"] = hashlib.sha256(token.encode()).hexdigest()
        wasm_cfg["configuration"]["value"] = json.dumps(value)
        cfg["static_resources"]["listeners"].append(listener)
        proxy = Envoy(envoy_bin, cfg, name="istio-admin", log_level="warn", component_log_level="wasm:info").start()
        key = "istio-" + uuid.uuid4().hex
        headers = {"idempotency-key": key, "content-type": "application/json"}
        assert proxy.post("/orders", b'{"item":"book"}', headers).status == 201
        port = proxy.listener_ports["idempotency_admin"]
        listed = request(port, "GET", "/idempotency/records?key=" + key, None, {"authorization": "Bearer " + token})
        assert listed.status == 200, listed
        assert [r["key"] for r in json.loads(listed.body)["records"]] == [key]
        assert request(port, "GET", "/idempotency/records?key=" + key, None, {}).status == 401
    finally:
        if proxy is not None:
            proxy.stop()
        etcd.stop()
        up.stop()


def test_envoyfilter_typed_config_serves_a_replay(envoy_bin, filter_wasm):
    up = Upstream("istio-orders").start()
    etcd = Etcd("istio-etcd").start()
    proxy = None
    try:
        cfg = _bootstrap("gateway/envoyfilter.yaml", filter_wasm, up.port, etcd.client_port)
        proxy = Envoy(envoy_bin, cfg, name="istio-gateway", log_level="warn",
                      component_log_level="wasm:info").start()
        key = "istio-" + uuid.uuid4().hex
        headers = {"idempotency-key": key, "content-type": "application/json"}
        first = proxy.post("/orders", b'{"item":"book"}', headers)
        assert first.status == 201 and not first.replayed, first
        again = proxy.post("/orders", b'{"item":"book"}', headers)
        assert again.status == 201 and again.replayed and again.body == first.body, again
        assert up.executions(key) == 1
    finally:
        if proxy is not None:
            proxy.stop()
        etcd.stop()
        up.stop()


# What istio-agent sends Envoy instead of the Wasm config when it cannot pull the image (with
# FAIL_CLOSE or FAIL_RELOAD semantics on the agent side): an RBAC filter that allows nothing.
RBAC_DENY_ALL = {"@type": RBAC_TYPE, "rules": {}}


def _write_ecds(path: Path, name: str, typed_config: dict) -> None:
    """One ECDS update as a file: a DiscoveryResponse, moved into place (Envoy watches moves)."""
    resp = {"resources": [{"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                           "name": name, "typed_config": typed_config}]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(resp))
    os.replace(tmp, path)


def _ecds_failures(proxy: Envoy) -> int:
    return sum(v for k, v in proxy.stats("extension_config_discovery").items() if k.endswith(".config_fail"))


@pytest.mark.parametrize("type_urls", ["manifest", "wasm-only"])
def test_a_failed_pull_rbac_filter_is_applied_only_with_its_type_listed(type_urls, envoy_bin, filter_wasm, tmp_path):
    """The EnvoyFilter's HTTP_FILTER by file-based ECDS (the same type_urls; a file instead of
    ADS): first the Wasm config, served; then the RBAC deny-all istio-agent sends after a failed
    pull. With the manifest's type_urls Envoy applies it (403 from RBAC); with the Wasm type
    alone it rejects the update (config_fail) and keeps the previous config."""
    rel = "gateway/envoyfilter.yaml"
    doc = _doc(rel)
    ext = copy.deepcopy(_extension_config(doc))
    ext["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": str(filter_wasm)}}
    (http_filter,) = [p["patch"]["value"] for p in doc["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    discovery = copy.deepcopy(http_filter["config_discovery"])
    if type_urls == "wasm-only":
        discovery["type_urls"] = [WASM_TYPE]
    ecds = tmp_path / "ecds" / "filter.json"
    ecds.parent.mkdir()
    discovery["config_source"] = {"path_config_source": {"path": str(ecds), "watched_directory": {"path": str(ecds.parent)}},
                                  "resource_api_version": "V3"}
    _write_ecds(ecds, ext["name"], ext["typed_config"])
    up = Upstream("istio-ecds-orders").start()
    etcd = Etcd("istio-ecds-etcd").start()
    proxy = None
    try:
        etcd_name = json.loads(ext["typed_config"]["config"]["configuration"]["value"])["store"]["cluster"]
        hcm = bootstrap.http_connection_manager([bootstrap.route("/", timeout="15s")],
                                                [{"name": http_filter["name"], "config_discovery": discovery}])
        cfg = bootstrap.bootstrap(hcm, [bootstrap.cluster("orders", up.port),
                                        bootstrap.etcd_cluster([etcd.client_port], name=etcd_name)])
        cfg["node"] = {"id": "gateway", "cluster": "istio-ingressgateway"}  # xDS needs a node
        proxy = Envoy(envoy_bin, cfg, name="istio-ecds-" + type_urls, log_level="info",
                      component_log_level="wasm:info").start()
        key = "ecds-" + uuid.uuid4().hex
        headers = {"idempotency-key": key, "content-type": "application/json"}
        first = proxy.post("/orders", b'{"item":"book"}', headers)
        assert first.status == 201 and not first.replayed, first

        _write_ecds(ecds, ext["name"], RBAC_DENY_ALL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = proxy.post("/orders", b'{"item":"book"}', headers).status
            if status == 403 or _ecds_failures(proxy) > 0:
                break
            time.sleep(0.1)
        after = proxy.post("/orders", b'{"item":"book"}', headers)
        if type_urls == "manifest":
            assert after.status == 403, after  # RBAC: the filter chain refuses every request
            assert _ecds_failures(proxy) == 0, proxy.stats("extension_config_discovery")
        else:
            assert _ecds_failures(proxy) >= 1, proxy.stats("extension_config_discovery")
            assert "RBAC" in proxy.log_text(), proxy.log_text()[-3000:]
            assert after.status == 201 and after.replayed, after  # the old Wasm config stays
    finally:
        if proxy is not None:
            proxy.stop()
        etcd.stop()
        up.stop()


# ---- istio/stats-tags.yaml: the route and outcome labels on Istio --------------------------

def _override() -> dict:
    doc = load(STATS_TAGS_FILE)
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "ConfigMap")
    # The key istio-agent reads: the annotation mounts the ConfigMap at
    # /etc/istio/custom-bootstrap and sets ISTIO_BOOTSTRAP_OVERRIDE to .../custom_bootstrap.json.
    assert set(doc["data"]) == {"custom_bootstrap.json"}
    return json.loads(doc["data"]["custom_bootstrap.json"])


def test_the_stats_tags_override_carries_the_shipped_tags_and_nothing_else():
    override = _override()
    assert override == {"stats_config": bootstrap.shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")}
    assert "sidecar.istio.io/bootstrapOverride: %s" % load(STATS_TAGS_FILE)["metadata"]["name"] in STATS_TAGS_FILE.read_text()


def test_the_template_renders_as_istio_renders_it():
    """The renderer is right where Istio's own golden file says (pkg/bootstrap/testdata/
    default_golden.json, stats_config, at the vendored commit): its tags and its matcher."""
    cfg = istio_bootstrap.render()
    names = [t["tag_name"] for t in cfg["stats_tags"]]
    assert names == ["cluster_name", "http_conn_manager_prefix", "thread_name", "tcp_prefix", "response_code",
                     "response_code_class", "http_conn_manager_listener_prefix", "listener_address",
                     "mongo_prefix", "cache", "component", "tag", "wasm_filter", "authz_enforce_result",
                     "authz_dry_run_action", "authz_dry_run_result"]
    assert cfg["use_all_default_tags"] is False
    patterns = cfg["stats_matcher"]["inclusion_list"]["patterns"]
    assert {"prefix": "wasm"} in patterns and {"safe_regex": {"regex": "vhost\\..*\\.route\\..*"}} in patterns
    # extraStatTags (ProxyConfig, sidecar.istio.io/extraStatTags) add only Istio's fixed form.
    (extra,) = [t for t in istio_bootstrap.render(extraStatTags=["route"])["stats_tags"] if t["tag_name"] == "route"]
    assert extra["regex"] == "(route=\\.=(.*?);\\.;)"


@pytest.mark.parametrize("extra", [[], ["dlp_status"]])
def test_the_override_adds_our_tags_to_istios_and_keeps_its_matcher(extra):
    istio = {"stats_config": istio_bootstrap.render(extraStatTags=extra)}
    merged = istio_bootstrap.merge_override(istio, _override())["stats_config"]
    ours = _override()["stats_config"]["stats_tags"]
    assert merged["stats_tags"] == istio["stats_config"]["stats_tags"] + ours
    names = [t["tag_name"] for t in merged["stats_tags"]]
    assert len(names) == len(set(names)), names
    assert merged["stats_matcher"] == istio["stats_config"]["stats_matcher"]
    assert merged["use_all_default_tags"] is False


def _istio_like_envoy(envoy_bin, filter_wasm, upstream, closed, name, extra_args):
    filter_config = {"store": {"type": "local", "capacity": 100},
                     "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True},
                                {"name": "payments.v2", "match": {"prefix": "/payments"}, "require_key": True}]}
    cfg = bootstrap.orders_proxy(upstream.port, closed.port, filter_config, filter_wasm,
                                 stats_config=istio_bootstrap.render())
    return Envoy(envoy_bin, cfg, name=name, log_level="warn", component_log_level="wasm:info",
                 extra_args=extra_args).start()


def test_on_istios_stats_config_the_override_gives_the_labels(envoy_bin, filter_wasm, tmp_path):
    """A real Envoy with Istio's stats_config (its tags, use_all_default_tags false, its
    matcher), without and then with the override passed as istio-agent passes it."""
    override = json.dumps(_override())
    up = Upstream("istio-stats-orders").start()
    closed = ClosedPort()
    try:
        for label, extra_args in (("without", []), ("with", ["--config-yaml", override])):
            proxy = _istio_like_envoy(envoy_bin, filter_wasm, up, closed, "istio-stats-" + label, extra_args)
            try:
                key = "istio-stats-" + uuid.uuid4().hex
                assert proxy.post("/orders", b"{}", {"idempotency-key": key}).status == 201
                assert proxy.post("/orders", b"{}", {"idempotency-key": key}).replayed
                assert proxy.post("/payments", b"{}", {"idempotency-key": key}).status == 201
                proxy.wait_counter("stored", 2)
                text = proxy.prometheus()
                lines = [line for line in text.splitlines() if line.startswith("idempotency_")]
                if label == "without":
                    # What a sidecar or gateway gets without the override: the rule and the
                    # outcome in the name (kept by Istio's matcher: its "wasm" prefix).
                    assert "idempotency_route_orders_requests_total_replayed{} 1" in lines, lines
                    assert "idempotency_route_payments_v2_requests_total_claimed{} 1" in lines, lines
                    assert not any(line.startswith("idempotency_requests_total") for line in lines)
                    # The version and the revision in the name, dots made underscores.
                    assert "idempotency_build_info_version_%s_revision_%s{} 1" % (
                        re.sub(r"[^A-Za-z0-9]", "_", crate_version()), module_revision()) in lines, lines
                    assert not any(line.startswith("idempotency_build_info{") for line in lines)
                else:
                    assert 'idempotency_requests_total{route="orders",outcome="replayed"} 1' in lines, lines
                    assert 'idempotency_requests_total{route="payments.v2",outcome="claimed"} 1' in lines, lines
                    assert 'idempotency_build_info{version="%s",revision="%s"} 1' % (
                        crate_version(), module_revision()) in lines, lines
                    assert "# TYPE idempotency_build_info gauge" in text
                    families = set(re.findall(r"^# TYPE (idempotency_\w+) counter$", text, re.M))
                    assert families == {"idempotency_requests_total", "idempotency_unmatched_requests_total",
                                        "idempotency_records_swept_total",
                                        "idempotency_claims_renewed_total", "idempotency_claims_lost_total",
                                        "idempotency_store_watch_ended_total",
                                        "idempotency_unknown_cluster_calls_total"}, families
                for line in lines:
                    assert not line.startswith("idempotency_") or re.match(r"[a-z0-9_]+(\{[^}]*\})? \d+$", line), line
            finally:
                proxy.stop()
    finally:
        closed.close()
        up.stop()


def test_per_workload_rules_and_a_namespace_wide_rollout():
    """Issue 47: one root-namespace EnvoyFilter carries one routes list for every selected
    workload. istio/workloads/ shows the two other shapes: one workload's own rules in its own
    namespace, selected by its labels, and a whole namespace (no selector), here in shadow mode.
    Each is the mesh form's filter (same module, vm_id, root_id, store) with its own ECDS name
    and its own rules, and no ECDS name is used twice in istio/."""
    mesh = _extension_config(_doc("mesh/envoyfilter.yaml"))["typed_config"]["config"]
    mesh_cfg = json.loads(mesh["configuration"]["value"])
    names = []
    for rel in FILES:
        doc = _doc(rel)
        if doc["kind"] == "EnvoyFilter":
            names += [p["patch"]["value"]["name"] for p in doc["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
    assert len(names) == len(set(names)), names
    payments, namespace = _doc("workloads/payments-envoyfilter.yaml"), _doc("workloads/namespace-envoyfilter.yaml")
    assert payments["metadata"]["namespace"] == "payments" and payments["spec"]["workloadSelector"]["labels"] == {"app": "payments"}
    assert namespace["metadata"]["namespace"] == "orders" and "workloadSelector" not in namespace["spec"]
    for doc in (payments, namespace):
        ext = _extension_config(doc)
        assert ext["name"].startswith(doc["metadata"]["namespace"] + ".")
        config = ext["typed_config"]["config"]
        assert {k: v for k, v in config.items() if k != "configuration"} == {k: v for k, v in mesh.items() if k != "configuration"}
        cfg = json.loads(config["configuration"]["value"])
        assert cfg["store"] == mesh_cfg["store"] and cfg["scope_host"] == "cluster"
        assert cfg["routes"] != mesh_cfg["routes"]
    assert json.loads(_extension_config(namespace)["typed_config"]["config"]["configuration"]["value"])["mode"] == "shadow"
