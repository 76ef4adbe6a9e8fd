"""The audit trail (issue 46; an operations promise, no contract row): with `"audit": true` each
change a protected request makes to a record (here a completion, and a release) is one JSON
entry in its access log line, through Envoy's own access log (`%FILTER_STATE(wasm.idempotency.audit:PLAIN)%`,
as envoy/*.yaml print it); a replay changes nothing and has none. Every admin request is one
entry in the admin listener's access log: what was done to which record, whose it is, its state
before and after, the token's digest prefix and the peer. Read from a real Envoy's log files, on
both stores (on etcd a completion is written by the worker's root while the response waits, and
published from there; an unknown outcome written after the stream's log line has none, as
OPERATIONS.md says). Fails on a build before `audit`, which refuses the field."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

import harness
from harness import key_headers, new_key
from idemkit.bootstrap import admin_listener
from idemkit.client import request

LOGS = Path(harness.LOG_ROOT)
DATA_LOG = LOGS / "test_audit.access.log"
ADMIN_LOG = LOGS / "test_audit.admin.log"
TOKEN = "e2e-audit-token"
STORE = {"type": "local", "capacity": 1000}
FILTER_CONFIG = {
    "store": STORE,
    "audit": True,
    "tenant_header": "x-tenant-id",
    "routes": [{"name": "pay", "match": {"prefix": "/pay"}, "require_key": True, "processing_timeout": "3s"}],
}
ADMIN_CONFIG = {"store": STORE, "admin": {"token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}}
LINE = "%REQ(IDEMPOTENCY-KEY)% %RESPONSE_CODE% %FILTER_STATE(wasm.idempotency.audit:PLAIN)%\n"
ADMIN_LINE = "%FILTER_STATE(wasm.idempotency.audit:PLAIN)%\n"
BODY = b'{"amount":"19.99"}'


@pytest.fixture(scope="module", params=["local", "etcd"])
def envoy(request, envoy_bin, filter_wasm, upstream):
    """On both stores: on etcd a completion is written by the worker's root while the response
    waits, and its entry is published from there."""
    LOGS.mkdir(parents=True, exist_ok=True)
    for log in (DATA_LOG, ADMIN_LOG):
        log.unlink(missing_ok=True)

    def admin(store: dict) -> list[dict]:
        log = [harness.text_file_access_log(ADMIN_LOG, ADMIN_LINE)]
        return [admin_listener(dict(ADMIN_CONFIG, store=store), filter_wasm, access_log=log)]

    with harness.envoy_on_store(request.param, "audit", envoy_bin, filter_wasm, upstream,
                                lambda store: dict(FILTER_CONFIG, store=store), listeners_for=admin,
                                route_timeout="1s",
                                access_log=[harness.text_file_access_log(DATA_LOG, LINE)]) as proxy:
        proxy.kind = request.param
        yield proxy


def lines_of(path: Path, count: int, what) -> list[str]:
    """The lines of `path` that `what` picks, once `count` are there (Envoy flushes its access
    logs within a second)."""
    deadline = time.monotonic() + 5
    while True:
        found = [line for line in (path.read_text().splitlines() if path.exists() else []) if what(line)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_completion_is_one_entry_and_its_replay_none(envoy, upstream):
    key = new_key()
    headers = key_headers(key, x_tenant_id="acme")
    first = envoy.post("/pay", BODY, headers)
    again = envoy.post("/pay", BODY, headers)
    assert first.status == 201 and again.replayed, (first, again)
    lines = lines_of(DATA_LOG, 2, lambda line: line.startswith(key + " "))
    assert len(lines) == 2, lines
    entry = json.loads(lines[0].split(" ", 2)[2])
    assert entry["event"] == "stored" and entry["state"] == "succeeded" and entry["status"] == 201, entry
    assert (entry["route"], entry["tenant"], entry["key"]) == ("pay", "acme", key), entry
    assert len(entry["record"]) == 12 and len(entry["fingerprint"]) == 16, entry
    assert entry["completed_ms"] >= entry["created_ms"] > 0, entry
    assert lines[1] == "%s 201 -" % key, lines


def test_an_admin_release_is_audited_with_its_states_token_and_peer(envoy, upstream):
    key = new_key()
    first = envoy.post("/pay", BODY, key_headers(key, x_tenant_id="acme", x_delay_ms="1500"))
    assert first.status == 504, first
    harness.wait_until(lambda: envoy.idem("outcome_unknown") >= 1, 5, what="the unknown outcome")
    admin_port, auth = envoy.listener_ports["idempotency_admin"], {"authorization": "Bearer " + TOKEN}
    if envoy.kind == "local":
        lines = lines_of(DATA_LOG, 1, lambda line: line.startswith(key + " "))
        data_entry = json.loads(lines[0].split(" ", 2)[2])
        assert (data_entry["event"], data_entry["state"], data_entry["status"]) == (
            "outcome_unknown", "outcome_unknown", None)
        tag = data_entry["record"]
    else:
        # On etcd the root writes the unknown outcome once etcd answers, after the stream's own
        # access log line (OPERATIONS.md, "The audit trail"): the operator finds it by key.
        listed = request(admin_port, "GET", "/idempotency/records?key=" + key, None, auth)
        [record] = json.loads(listed.body)["records"]
        assert record["state"] == "outcome_unknown", record
        tag = record["tag"]
    # Past its claim's lease, the operator releases it (etcd ends the lease by its own clock, a
    # few seconds late: refused until then, each refusal audited too).
    time.sleep(3.2)

    def release():
        return request(admin_port, "POST", "/idempotency/records/%s/release" % tag, None, auth).status == 200

    harness.wait_until(release, 10, 0.5, what="the release past the lease")
    entries = [json.loads(line) for line in lines_of(ADMIN_LOG, 1, lambda line: tag in line and "released" in line)]
    assert len(entries) == 1, entries
    e = entries[0]
    assert (e["event"], e["action"], e["record"], e["route"], e["tenant"], e["key"]) == (
        "admin", "released", tag, "pay", "acme", key), e
    assert (e["state_before"], e["state_after"], e["status"]) == ("outcome_unknown", "released", 200), e
    assert e["token"] == "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest()[:8], e
    assert e["peer"].startswith("127.0.0.1:"), e
    assert e["request"] == "POST /idempotency/records/%s/release" % tag, e
