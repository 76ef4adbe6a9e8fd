"""The unsettled records gauge (issue 47; an operations promise, no contract row): a request whose
outcome is unknown (here the route's timeout while the upstream works) shows at once in its
route's gauge, `idempotency_unsettled_records{route="pay",state="outcome_unknown"} 1` through the
shipped stats tags, and stays there while the record is unsettled; an operator's release through
the admin listener, once the claim's lease is over, takes it back to 0 within two of the
registry's checks (10 s: a check may fall to the admin listener's root, and the filter's root sets
its gauge at its own next look), with no request in between. On both stores: on etcd the check looks the record up
with a callout from the root. Fails on a build before the gauge, which has no such series."""

from __future__ import annotations

import hashlib
import json
import re
import time

import pytest

import harness
from harness import REPO_ROOT, key_headers, new_key
from idemkit.bootstrap import admin_listener, shipped_stats_config
from idemkit.client import request

TOKEN = "e2e-unsettled-token"
FILTER_CONFIG = {
    "routes": [{"name": "pay", "match": {"prefix": "/pay"}, "require_key": True, "processing_timeout": "3s"}],
}
ADMIN = {"admin": {"token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}}
SERIES = re.compile(r'^idempotency_unsettled_records\{([^}]*)\} (\S+)$', re.M)


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    def admin(store: dict) -> list[dict]:
        return [admin_listener(dict(ADMIN, store=store), filter_wasm)]

    with harness.envoy_on_store(request.param, "unsettled", envoy_bin, filter_wasm, upstream,
                                lambda store: dict(FILTER_CONFIG, store=store), listeners_for=admin,
                                route_timeout="1s",
                                stats_config=shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")) as proxy:
        yield proxy


def unsettled(envoy) -> dict[str, float]:
    """The gauge's series by state, as Prometheus scrapes them (route pay)."""
    found = {}
    for labels, value in SERIES.findall(envoy.prometheus(settle=False)):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if tags.get("route") == "pay":
            found[tags["state"]] = float(value)
    return found


def test_an_unknown_outcome_stays_in_the_gauge_until_an_operator_settles_it(envoy, upstream):
    key = new_key()
    first = envoy.post("/pay", b'{"amount":5}', key_headers(key, x_delay_ms="1500"))
    assert first.status == 504, first
    harness.wait_until(lambda: unsettled(envoy).get("outcome_unknown") == 1, 5, what="the gauge at 1")
    assert unsettled(envoy).get("processing") == 0
    # Still there a check later: nothing settled it.
    time.sleep(6)
    assert unsettled(envoy)["outcome_unknown"] == 1
    # The operator finds it and releases it past its claim's lease (etcd ends the lease by its
    # own clock, a few seconds late: refused until then).
    admin_port, auth = envoy.listener_ports["idempotency_admin"], {"authorization": "Bearer " + TOKEN}
    listed = request(admin_port, "GET", "/idempotency/records?key=" + key, None, auth)
    [record] = json.loads(listed.body)["records"]

    def release():
        path = "/idempotency/records/%s/release" % record["tag"]
        return request(admin_port, "POST", path, None, auth).status == 200

    harness.wait_until(release, 10, 0.5, what="the release past the lease")
    harness.wait_until(lambda: unsettled(envoy).get("outcome_unknown") == 0, 16, 0.5, what="the gauge back at 0")
    assert upstream.executions(key) == 1
