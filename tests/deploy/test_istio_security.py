"""deploy/istio/etcd-authorizationpolicy.yaml (issue 47): on Istio only the filter's sidecars
reach etcd, since whoever can write to etcd can forge an answer the filter replays. An ALLOW
policy on etcd's pods names the service accounts of the workloads the shipped per-workload and
namespace EnvoyFilters select (and etcd's own namespace, for its peers), on etcd's ports only;
STRICT mTLS makes those identities the callers'."""

from __future__ import annotations

import yaml

from idemkit import REPO_ROOT

POLICY = REPO_ROOT / "deploy" / "istio" / "etcd-authorizationpolicy.yaml"
ISTIO = REPO_ROOT / "istio"


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(POLICY.read_text())}


def test_only_the_filters_sidecars_reach_etcds_client_port():
    docs = _docs()
    assert set(docs) == {"AuthorizationPolicy", "PeerAuthentication"}
    policy = docs["AuthorizationPolicy"]
    assert policy["apiVersion"] == "security.istio.io/v1"
    spec = policy["spec"]
    assert spec["action"] == "ALLOW" and spec["selector"]["matchLabels"] == {"app": "etcd"}
    sidecars, peers = spec["rules"]
    principals = sidecars["from"][0]["source"]["principals"]
    assert principals and all(p.startswith("cluster.local/ns/") and "/sa/" in p for p in principals)
    assert sidecars["to"] == [{"operation": {"ports": ["2379"]}}]
    # Every namespace a shipped per-workload or namespace EnvoyFilter protects has its identity here.
    protected = {yaml.safe_load(p.read_text())["metadata"]["namespace"] for p in (ISTIO / "workloads").glob("*.yaml")}
    assert protected == {p.split("/")[2] for p in principals}
    assert peers["from"][0]["source"]["namespaces"] == [policy["metadata"]["namespace"]]
    # No rule without a source: an ALLOW rule with no `from` would let every workload in.
    assert all(rule.get("from") for rule in spec["rules"])


def test_the_etcd_namespace_is_the_one_the_manifests_call():
    """The policy sits where the manifests' store cluster points
    (outbound|2379||etcd.<namespace>.svc.cluster.local), with STRICT mTLS on etcd's pods."""
    docs = _docs()
    mesh = (ISTIO / "mesh" / "envoyfilter.yaml").read_text()
    namespace = docs["AuthorizationPolicy"]["metadata"]["namespace"]
    assert "outbound|2379||etcd.%s.svc.cluster.local" % namespace in mesh
    peer = docs["PeerAuthentication"]
    assert peer["metadata"]["namespace"] == namespace and peer["spec"]["mtls"]["mode"] == "STRICT"
    assert peer["spec"]["selector"] == docs["AuthorizationPolicy"]["spec"]["selector"]
