"""istio/: the WasmPlugin and EnvoyFilter forms for an ingress gateway (istio/gateway) and
mesh-wide in the root namespace (istio/mesh). Each manifest parses; the image is the one
`make oci` tags; every plugin configuration is accepted by the filter's own parser (and the
parser is shown to refuse a broken one); the two forms of a directory carry the same
configuration; and each EnvoyFilter's Wasm typed_config, with the module as the local file
istio-agent turns the oci:// URL into, passes `envoy --mode validate` in a minimal bootstrap and,
run for real against etcd and the demo upstream, serves a first call and its replay (C8, C9)."""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from pathlib import Path

import pytest

from conftest import envoy_validate
from idemkit import bootstrap
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd
from idemkit.process import Upstream
from manifests import ISTIO_DIR, RBAC_TYPE, WASM_TYPE, as_json, check_configs, crate_version, load_all

FILES = sorted(p.relative_to(ISTIO_DIR).as_posix() for p in ISTIO_DIR.rglob("*.yaml"))
DIRS = ("gateway", "mesh")


def _doc(rel: str) -> dict:
    docs = load_all(ISTIO_DIR / rel)
    assert len(docs) == 1, rel
    return docs[0]


def _extension_config(doc: dict) -> dict:
    patches = [p for p in doc["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
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
                     "mesh/envoyfilter.yaml", "mesh/wasmplugin.yaml"]
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
    assert url.startswith("oci://"), url
    return url.rsplit(":", 1)[1]


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
    assert spec["workloadSelector"]["labels"]
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
