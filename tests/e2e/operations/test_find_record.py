"""deploy/istio/find_record.py (issue 47): asks every pod's admin API for a key and says which pod
holds its record. Two real Envoys on the local store stand in for two pods of one workload (each
sidecar holds its own records there): a key sent to one is found on that one and not the other,
a key sent to none is found nowhere (exit 1), and a pod that refuses the token is said to be one
(exit 2) while the others are still asked."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

import harness
from harness import REPO_ROOT, key_headers, new_key
from idemkit.bootstrap import admin_listener

SCRIPT = REPO_ROOT / "deploy" / "istio" / "find_record.py"
TOKEN = "e2e-find-token"
STORE = {"type": "local", "capacity": 1000}
ADMIN_CONFIG = {"store": STORE, "admin": {"token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}}
FILTER_CONFIG = {"store": STORE, "routes": [{"name": "pay", "match": {"prefix": "/pay"}, "require_key": True}]}


@pytest.fixture(scope="module")
def pods(envoy_bin, filter_wasm, upstream):
    proxies = [harness.Envoy(envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm, name="pod-%s" % n,
                             extra_listeners=[admin_listener(ADMIN_CONFIG, filter_wasm)]).start() for n in "ab"]
    yield proxies
    for p in proxies:
        p.stop()


def find(pods, key: str, token: str = TOKEN) -> tuple[int, list[str]]:
    endpoints = ["--endpoint=pod-%s=http://127.0.0.1:%d" % (n, p.listener_ports["idempotency_admin"])
                 for n, p in zip("ab", pods)]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--key", key, *endpoints],
                          env={"IDEMPOTENCY_ADMIN_TOKEN": token, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout.splitlines()


def test_the_pod_that_served_a_key_is_the_one_found(pods, upstream):
    key = new_key()
    assert pods[1].post("/pay", b'{"amount":1}', key_headers(key)).status == 201
    status, lines = find(pods, key)
    assert status == 0, lines
    assert lines[0] == "pod-a\tnone", lines
    assert lines[1].startswith("pod-b\t") and "route=pay" in lines[1] and "state=completed" in lines[1], lines
    # The token is sent, never printed.
    assert all(TOKEN not in line for line in lines)


def test_a_key_nobody_holds_and_a_refused_token(pods):
    status, lines = find(pods, new_key())
    assert status == 1 and lines == ["pod-a\tnone", "pod-b\tnone"], lines
    status, lines = find(pods, new_key(), token="wrong")
    assert status == 2 and len(lines) == 2 and all("\terror: " in line and "401" in line for line in lines), lines
